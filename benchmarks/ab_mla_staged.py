"""The Hopper kernel's first fp8 producer warpgroup on alternate tiles taking its raw rows through a shared stage by
bulk copies (``STAGE``: ``kernel_sm90.STAGED``, :func:`dsa.mla.kernel_sm90._producer_staged`; the second warpgroup loads
its own into registers) against both loading them into registers through L1 (the default), in interleaved rounds
(CUDA-graph medians for decode, ``do_bench`` for prefill). The question: one tile of bulk copies in flight is 16-19%
slower than two (BENCHMARKS.md, fifty-second session); with the stage holding the first warpgroup's next tile while it
fills its buffer, and the second's loads as before, do more rows stay in flight, and is the fill, and the call, shorter?
Prints the largest difference between the variants' outputs (0: the stage changes no result) and the times. Small heads
run on the rows kernel (``SM90_ROWS_SMALL_HEADS``), as the defaults take them where the bulk kernel does not serve.

    python benchmarks/ab_mla_staged.py [ROUNDS] [CASE ...]     (GPU; sm_90)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import interleaved_us, mla_inputs  # noqa: E402
from dsa.mla import kernel as K  # noqa: E402
from dsa.mla import kernel_sm90  # noqa: E402

VARIANTS = {"loads": 0, "staged": 1}
# (name, T, h_q, topk, num_req, s_kv); fp8_ds_mla, decode at s_q 1 unless T > num_req
CASES = [(f"fp8 h32 b{b}", b, 32, 2048, b, 32768) for b in (32, 64, 128)]
CASES += [(f"fp8 h16 b{b}", b, 16, 2048, b, 32768) for b in (32, 64, 128)]
CASES += [("prefill fp8 h32", 4096, 32, 2048, 1, 131072), ("prefill fp8 h16", 4096, 16, 2048, 1, 131072)]


def main():
    args = sys.argv[1:]
    rounds = int(args[0]) if args else 3
    names = args[1:]
    sm = 192 ** -0.5
    table = []
    real = kernel_sm90._run_staged
    for name, T, h, topk, nreq, s_kv in CASES:
        if names and name not in names:
            continue
        q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, "fp8_ds_mla", block_size=64)
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
        staged = []
        base = dict(K.SM90_ROWS_SMALL_HEADS, block_h=16 if h <= 16 else 32)

        def call(st):
            return K.sparse_mla_triton(q, flat, idx, sm, out=out, config=dict(base, producer=dict(stage=st)))

        kernel_sm90._run_staged = lambda *a: (staged.append(1), real(*a))[1]
        try:
            res = {v: [x.clone() for x in call(st)] for v, st in VARIANTS.items()}
            torch.cuda.synchronize()
        finally:
            kernel_sm90._run_staged = real
        diff = max((res[v][i].float() - res["loads"][i].float()).abs().nan_to_num(0, 0, 0).max().item()
                   for v in VARIANTS for i in range(3))
        times = interleaved_us({v: (lambda st=st: call(st)) for v, st in VARIANTS.items()}, rounds,
                               not name.startswith("prefill"))
        med = {v: sorted(x)[len(x) // 2] for v, x in times.items()}
        print(name, "staged" if staged else "not staged", f"diff {diff:.3g}",
              {v: [round(x, 1) for x in xs] for v, xs in times.items()}, flush=True)
        table.append((name, bool(staged), diff, med))
        q = kv = idx = flat = out = res = None
        torch.cuda.empty_cache()
    print(f"\n{'case (median us)':<20}{'staged':>8}{'diff':>8}" + "".join(f"{v:>10}" for v in VARIANTS) + f"{'%':>8}")
    for name, st, diff, med in table:
        print(f"{name:<20}{str(st):>8}{diff:8.2g}" + "".join(f"{med[v]:10.1f}" for v in VARIANTS)
              + f"{(med['staged'] / med['loads'] - 1) * 100:+8.1f}")


if __name__ == "__main__":
    main()
