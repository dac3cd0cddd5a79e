"""Benchmark dsa.sparse_mla on the goal shapes against a PyTorch gather + bmm baseline.

    python benchmarks/bench_mla.py            # goal shapes (H200: see dsa/constants.py ceilings)
    python benchmarks/bench_mla.py --quick    # smaller shapes
    python benchmarks/bench_mla.py --sweep    # also time alternative launch configs per shape

FLOPs per query token: 2 · h_q · valid_topk · (576 + 512). Bytes (the floor for memory-bound
decode): q read + gathered cache rows (576·2 or 656 bytes each, every (token, entry) counted) +
indices + out written. Times are ``triton.testing.do_bench`` medians; every input is far larger
than the 60 MB L2 (the gathered rows are random over a large cache), so no rotation is needed.
The baseline (PyTorch: gather rows, dequantise fp8, bmm, fp32 softmax, bmm) runs in token chunks.

Measured numbers (date, commit, H200) are in BENCHMARKS.md, the one record of them.

An L2 bulk prefetch of the rows 1-2 tiles ahead (inline PTX) was tried and measured 0-14 % slower on
every shape, so it was removed.
"""
from __future__ import annotations

import argparse
import os
import time
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa import bench as B  # noqa: E402  (the suites live in dsa/bench.py; `dsa bench` runs them all)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="launch each variant once (fills Triton's cache)")
    ap.add_argument("--shapes", default="", help="comma-separated subset of shape names")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds; skip what would start after it")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    args = ap.parse_args()
    t0 = time.time()
    dev = "cpu" if args.cpu_smoke else "cuda"
    size = "smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    if dev == "cuda":
        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  ceilings: "
              f"{B.H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, {B.H200_COPY_BYTES_PER_S / 1e12:.1f} TB/s")
    sweep_rows = []
    rows = B.mla_suite(size, args.sweep, dev, not args.no_baseline,
                       shapes=[s for s in args.shapes.split(",") if s] or None, compile_only=args.compile_only,
                       deadline=args.deadline, sweep_rows=sweep_rows)
    if args.compile_only:
        print(f"# compiled in {time.time() - t0:.1f} s")
        return
    if args.sweep:
        print("\n## sweep (every variant)")
        print(f"{'shape':<20} {'variant':<60} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>8}")
        for name, var, ms, tf, gbs in sweep_rows:
            print(f"{name:<20} {var:<60} {ms:8.3f} {tf:8.1f} {gbs:8.0f}")
    print("\n## sparse_mla (public path, default config; best swept variant last)")
    print(f"{'shape':<20} {'dims':<36} {'ms':>8} {'TFLOP/s':>8} {'%flops':>7} {'GB/s':>7} {'%bw':>5} "
          f"{'torch ms':>9} {'speedup':>8}  best variant")
    for r in rows:
        print(f"{r['case']:<20} {r['shape']:<36} {r['ms']:8.3f} {r['tflops']:8.1f} {r['pct_flops']:6.1f}% "
              f"{r['gbs']:7.0f} {r['pct_bw']:4.0f}% {r['base_ms']:9.3f} {r['speedup']:7.1f}x  {r['cfg'] or ''}")


if __name__ == "__main__":
    main()
