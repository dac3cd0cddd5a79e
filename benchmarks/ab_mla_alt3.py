"""Three fp8 producer warpgroups taking turns at the tiles of a 16/32-head group (``warps`` 12 in
``kernel_sm90.PRODUCER_ROWS_FP8``: two warpgroups' rows in flight while the third dequantises, at 96 registers
each, the math warpgroup 224) against the default two (120 registers, all four groups loaded before the wait), in
interleaved rounds. Checks every variant against the reference (decode) and bitwise against the default, then prints
the times. GPU (sm_90).

    python benchmarks/ab_mla_alt3.py [ROUNDS] [CASE ...]
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import mla_inputs, mla_run_checked  # noqa: E402
from dsa.mla import kernel_sm90 as K  # noqa: E402
from dsa.mla import sparse_mla, sparse_mla_ref  # noqa: E402

DEFAULT = dict(K.PRODUCER_ROWS_FP8)
VARIANTS = {"default": DEFAULT, "alt3 e2": dict(DEFAULT, warps=12, regs=96, early=2),
            "alt3 e3": dict(DEFAULT, warps=12, regs=96, early=3)}
# (name, T, h_q, topk, num_req, s_kv); fp8_ds_mla cache, decode rows s_q 1 (32K context each)
CASES = [(f"h32 b{b}", b, 32, 2048, b, 32768) for b in (32, 64, 128)]
CASES += [("h16 b16", 16, 16, 2048, 16, 32768), ("prefill h32", 4096, 32, 2048, 1, 131072),
          ("prefill h16", 4096, 16, 2048, 1, 131072)]


def main():
    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and args[0].isdigit() else 3
    cases = [c for c in CASES if not args or c[0].replace(" ", "_") in args]
    sm = 192 ** -0.5
    rows = []
    for name, T, h_q, topk, nreq, s_kv in cases:
        q, kv, idx = mla_inputs(T, h_q, topk, nreq, s_kv, "fp8_ds_mla")
        out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device="cuda")

        def fn():
            return sparse_mla(q, kv, idx, sm, out=out, backend="triton")
        prefill = T > nreq
        want = None if prefill else sparse_mla_ref(q, kv, idx, sm)
        res, errs = {}, {}
        for n, v in VARIANTS.items():
            K.PRODUCER_ROWS_FP8 = v
            res[n], err = mla_run_checked(fn, out, want)
            if err is not None:
                errs[n] = err
        same = {n: all(torch.equal(res["default"][k], res[n][k]) for k in range(3)) for n in VARIANTS}
        times = {n: [] for n in VARIANTS}
        for _ in range(rounds):
            for n, v in VARIANTS.items():
                K.PRODUCER_ROWS_FP8 = v
                bench = do_bench if prefill else do_bench_cudagraph
                times[n].append(bench(fn, rep=200 if prefill else 100, return_mode="median") * 1e3)
        K.PRODUCER_ROWS_FP8 = DEFAULT
        rows.append((name, same, errs, times))
        print(name, same, {k: tuple(f"{e:.2g}" for e in v) for k, v in errs.items()},
              {k: [round(t, 1) for t in ts] for k, ts in times.items()}, flush=True)
        q = kv = idx = out = want = res = None
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}; medians of {rounds} interleaved rounds, µs (decode: CUDA graphs)")
    print(f"{'case':<14}{'bitwise':>9}  " + "".join(f"{n:<26}" for n in VARIANTS))
    for name, same, errs, t in rows:
        med = {n: sorted(v)[len(v) // 2] for n, v in t.items()}
        cells = [" / ".join(f"{x:.1f}" for x in t[n]) + f" {(med[n] / med['default'] - 1) * 100:+.1f}%" for n in VARIANTS]
        print(f"{name:<14}{'yes' if all(same.values()) else 'NO':>9}  " + "".join(f"{c:<26}" for c in cells))


if __name__ == "__main__":
    main()
