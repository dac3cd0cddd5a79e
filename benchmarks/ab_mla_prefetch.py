"""The Hopper kernel's producers with an L2 prefetch of their rows 1 or 2 of their own tiles ahead (``PF``:
``kernel_sm90.PREFETCH``, one ``cp.async.bulk.prefetch.L2`` per row) against without, in interleaved rounds
(CUDA-graph medians for decode, ``do_bench`` for prefill). The question: are the fp8 fill's row loads short of bytes
in flight (a read-only walk needs about 170 KB per SM for 3.1-3.3 TB/s; the fill has at most two tiles' rows, 84 KB,
and streams at 2.3-2.8 TB/s: BENCHMARKS.md, twenty-third and forty-eighth sessions)? Prints the largest difference
between the variants' outputs (0: the prefetch changes no result) and the times.

    python benchmarks/ab_mla_prefetch.py [ROUNDS] [CASE ...]     (GPU; sm_90)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import interleaved_us, mla_inputs  # noqa: E402
from dsa.mla import kernel as K  # noqa: E402
from dsa.mla import kernel_sm90  # noqa: E402

VARIANTS = {"pf0": 0, "pf1": 1, "pf2": 2}
# (name, T, h_q, topk, num_req, s_kv, format); decode: s_q 1 unless T > num_req
CASES = [(f"fp8 h32 b{b}", b, 32, 2048, b, 32768, "fp8_ds_mla") for b in (1, 32, 64, 128)]
CASES += [(f"fp8 h16 b{b}", b, 16, 2048, b, 32768, "fp8_ds_mla") for b in (1, 16)]
CASES += [("fp8 h128 b128x2", 256, 128, 2048, 128, 32768, "fp8_ds_mla")]
CASES += [(f"bf16 h16 b{b}", b, 16, 2048, b, 32768, "bf16") for b in (32, 64)]
CASES += [("bf16 h32 b32", 32, 32, 2048, 32, 32768, "bf16")]
CASES += [("prefill fp8 h16", 4096, 16, 2048, 1, 131072, "fp8_ds_mla"), ("prefill bf16 h32", 4096, 32, 2048, 1, 131072,
                                                                          "bf16")]


def main():
    args = sys.argv[1:]
    rounds = int(args[0]) if args else 3
    names = args[1:]
    sm = 192 ** -0.5
    table = []
    real_launch = kernel_sm90.launch
    for name, T, h, topk, nreq, s_kv, fmt in CASES:
        if names and name not in names:
            continue
        q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, block_size=64)
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
        launches = []

        def spy(*a, **k):
            launches.append(k.get("producer"))
            return real_launch(*a, **k)

        base = dict(K.SM90_ROWS_SMALL_HEADS, block_h=16 if h <= 16 else 32) if h < 64 else {}

        def call(pf):  # (small heads: the rows kernel, as the defaults take it where the bulk kernel does not serve)
            return K.sparse_mla_triton(q, flat, idx, sm, out=out, config=dict(base, producer=dict(prefetch=pf)))

        kernel_sm90.launch = spy
        try:
            res = {}
            for v, pf in VARIANTS.items():
                res[v] = [x.clone() for x in call(pf)]
            torch.cuda.synchronize()
        finally:
            kernel_sm90.launch = real_launch
        served = bool(launches)  # (else another kernel served: the variants are the same call)
        diff = max((res[v][i].float() - res["pf0"][i].float()).abs().nan_to_num(0, 0, 0).max().item()
                   for v in VARIANTS for i in range(3))
        times = interleaved_us({v: (lambda pf=pf: call(pf)) for v, pf in VARIANTS.items()}, rounds,
                               not name.startswith("prefill"))
        med = {v: sorted(x)[len(x) // 2] for v, x in times.items()}
        print(name, "sm90" if served else "other kernel", f"diff {diff:.3g}",
              {v: [round(x, 1) for x in xs] for v, xs in times.items()}, flush=True)
        table.append((name, served, diff, med))
        q = kv = idx = flat = out = res = None
        torch.cuda.empty_cache()
    print(f"\n{'case (median us)':<20}{'kernel':>8}{'diff':>8}" + "".join(f"{v:>10}" for v in VARIANTS)
          + "".join(f"{v + ' %':>9}" for v in list(VARIANTS)[1:]))
    for name, served, diff, med in table:
        print(f"{name:<20}{'sm90' if served else 'other':>8}{diff:8.2g}" + "".join(f"{med[v]:10.1f}" for v in VARIANTS)
              + "".join(f"{(med[v] / med['pf0'] - 1) * 100:+9.1f}" for v in list(VARIANTS)[1:]))


if __name__ == "__main__":
    main()
