"""The Hopper kernel's 16/32-head math warpgroup with P taken against the earlier tiles' max (``LAZY``: one barrier
round per tile, the accumulator rescaled only when a tile's max grows by more than ``LAZY_TAU``) against the
default, in interleaved rounds, at both small head-group sizes (the library takes it for 32-head groups only,
``kernel_sm90.LAZY_MAX``). Reports each variant's largest |out - reference| and lse error on the decode rows (the
PyTorch reference), the largest difference between the variants everywhere, and the times. H200.

    python benchmarks/ab_mla_lazy.py [ROUNDS]
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import _replay  # noqa: E402
from dsa.bench import MLA_SHAPES, mla_inputs, mla_run_checked  # noqa: E402
from dsa.mla import kernel_sm90 as K  # noqa: E402
from dsa.mla import sparse_mla, sparse_mla_ref  # noqa: E402

VARIANTS = {"default": (), "lazy": (16, 32)}  # kernel_sm90.LAZY_MAX: the head groups that take it
# (name, T, h_q, topk, num_req, s_kv, format); decode rows: s_q 1 unless T > num_req
CASES = [(f"fp8 h16 b{b}", b, 16, 2048, b, 32768, "fp8_ds_mla") for b in (1, 16, 32, 64, 128)]
CASES += [(f"fp8 h32 b{b}", b, 32, 2048, b, 32768, "fp8_ds_mla") for b in (16, 64, 128)]
CASES += [(f"bf16 h16 b{b}", b, 16, 2048, b, 32768, "bf16") for b in (1, 32, 64)]
CASES += [(n, *MLA_SHAPES[n]) for n in ("decode_fp8_h16", "prefill_bf16_h16", "prefill_bf16_h32")]


def main():
    _replay.set_enabled(False)  # (each call decides afresh: this script switches the dispatch between calls)
    saved = K.LAZY_MAX
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sm = 192 ** -0.5
    rows = []
    for name, T, h_q, topk, nreq, s_kv, fmt in CASES:
        q, kv, idx = mla_inputs(T, h_q, topk, nreq, s_kv, fmt)
        out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device="cuda")

        def fn():
            return sparse_mla(q, kv, idx, sm, out=out, backend="triton")
        prefill = name.startswith("prefill")
        want = None if prefill else sparse_mla_ref(q, kv, idx, sm)
        res, errs = {}, {}
        for n, v in VARIANTS.items():
            K.LAZY_MAX = v
            res[n], err = mla_run_checked(fn, out, want)
            if err is not None:
                errs[n] = err
        d = max((res["default"][k].float() - res["lazy"][k].float()).abs().max().item() for k in range(3))
        times = {n: [] for n in VARIANTS}
        for _ in range(rounds):
            for n, v in VARIANTS.items():
                K.LAZY_MAX = v
                if prefill:
                    times[n].append(do_bench(fn, warmup=20, rep=200, return_mode="median") * 1e3)
                else:
                    times[n].append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3)
        rows.append((name, d, errs, times))
        print(name, f"diff {d:.3g}", {k: tuple(f"{e:.2g}" for e in v) for k, v in errs.items()},
              {k: [round(t, 1) for t in ts] for k, ts in times.items()}, flush=True)
        q = kv = idx = out = want = res = None
        torch.cuda.empty_cache()
    K.LAZY_MAX = saved
    print(f"\n{'case':<20}{'diff':>8}  {'err out/lse/ml default':<24}{'err lazy':<24}" +
          "".join(f"{n + ' (µs)':<24}" for n in VARIANTS))
    for name, d, errs, t in rows:
        base = sorted(t["default"])[len(t["default"]) // 2]
        e = {n: "/".join(f"{x:.1g}" for x in errs[n]) if errs else "-" for n in VARIANTS}
        print(f"{name:<20}{d:8.3g}  {e['default']:<24}{e['lazy']:<24}" + "".join(
            f"{' / '.join(f'{x:.1f}' for x in t[n]) + f' {(sorted(t[n])[len(t[n]) // 2] / base - 1) * 100:+.1f}%':<24}"
            for n in VARIANTS))


if __name__ == "__main__":
    main()
