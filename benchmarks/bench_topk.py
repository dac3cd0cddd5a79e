"""Benchmark dsa.top_k_indices (exact Triton threshold selection) against torch.topk.

    python benchmarks/bench_topk.py            # goal shapes: 4096 x 131072 (prefill), 64 x 131072 (decode), k = 2048
    python benchmarks/bench_topk.py --quick    # smaller shapes
    python benchmarks/bench_topk.py --sweep    # also time several launch configurations per case
    TRITON_INTERPRET=1 python benchmarks/bench_topk.py --cpu-smoke   # tiny shapes, checks the script itself

GB/s counts the fp32 logits bytes that must be read (M * N * 4) over the time, compared with
the device-to-device copy ceiling of dsa.constants. The baseline is torch.topk(logits, k) on
the same tensor (full rows), timed in the same run. Every case first checks that the
kernel's selected values equal torch.topk's (as multisets, row by row). Times:
triton.testing.do_bench medians; the decode case rotates over 4 input sets (one set fits in L2).

Measured on an H200 (2026-11-29, torch 2.11 cu130, triton 3.6.0, SM clock 1980 MHz; --sweep
of the configurations of that day, fp32 N(0,1) logits, full rows, k = 2048):

    prefill 4096 x 131072: 2.032 ms = 1057 GB/s (24.6% of the copy ceiling); torch.topk 6.196 ms: 3.05x
        (block 2048 / 8 warps / 2 programs per SM / cap 8192 = today's default; block 4096 with
        16 warps, 1 per SM: 2.696 ms; block 8192, 16 warps: 2.460; block 4096, 8 warps, 1 per SM:
        2.969; same with 2 per SM and maxnreg 128: 2.247; 16 warps, 2 per SM, maxnreg 64: 2.483;
        rows of 32: 2.696; 128 sample runs: 2.773)
    decode 64 x 131072: 54.5 us = 615 GB/s (14.3%); torch.topk 190.0 us: 3.48x
        (4 slices per row = today's default; 8 slices: 126.7 us with a 16-warp merge, 73.0 us with
        an 8-warp merge; 16 slices: 111.7; 8 slices of 4096-value blocks / 16 warps: 88.7; of
        1024-value blocks / 4 warps: 78.2; fused path, one program per row: 89.8)

Reading: with one block of loads in flight per program, 2 programs x 8 KB per SM at ~2 us of
loaded-memory latency give ~8 GB/s per SM, i.e. the ~1.06 TB/s measured: the streaming pass is
latency-bound, not bandwidth- or issue-bound. ``prefetch`` (2-4 blocks in flight) targets
that and is the first thing to measure next (the sweep lists hold it; not yet run on a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa import bench as B  # noqa: E402  (the suites live in dsa/bench.py; `dsa bench` runs them all)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if args.cpu_smoke:
        dev, size = "cpu", "smoke"
    else:
        import triton

        dev, size = "cuda", "quick" if args.quick else "full"
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = B.topk_suite(size, args.sweep, dev)
    print(B.format_table(rows))
    for r in rows:
        print(f"config {r['case']}: {r['cfg'] or 'default'}")


if __name__ == "__main__":
    main()
