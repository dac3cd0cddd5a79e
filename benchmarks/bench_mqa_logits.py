"""Benchmark the lightning indexer's logits kernels against a PyTorch baseline.

    python benchmarks/bench_mqa_logits.py            # goal shapes (H200: 4096 x 131072 prefill; B=64, 32K-128K decode)
    python benchmarks/bench_mqa_logits.py --quick    # smaller shapes
    python benchmarks/bench_mqa_logits.py --sweep    # also time several launch configurations per case

Prefill: ``fp8_mqa_logits`` for the last M query rows of one request of N keys (ks = 0,
ke = N - M + i + 1); FLOPs counted as 2*M*N*H*D (DeepGEMM's convention) and compared with
the fp8 matmul ceiling of dsa.constants. Decode: ``fp8_paged_mqa_logits`` over B requests
with random contexts, a shuffled block table, block sizes 64 and 1, next_n 1 and 2;
GB/s counts the cache bytes that must be read (132 per key of each request) and is compared
with the device-to-device copy ceiling. The baseline is the reference's formulation on the
GPU in PyTorch: bf16 matmul of dequantised fp8 values, relu, weighted head sum (a bf16
bmm), chunked so its temporaries fit. Times: triton.testing.do_bench medians.

Decode on sm_90 runs the Gluon kernel wherever it is supported; ``--sweep`` also times
its launch configurations and the Triton kernel's (``gluon=False``). Measured numbers (date, GPU,
commit, shapes) are in BENCHMARKS.md.
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
    ap.add_argument("--only", choices=["prefill", "decode"], default=None)
    ap.add_argument("--block-sizes", default="64,1", help="decode cache block sizes, comma-separated")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    args = ap.parse_args()
    if args.cpu_smoke:
        dev, size = "cpu", "smoke"
    else:
        assert torch.cuda.is_available(), "needs a GPU (or --cpu-smoke with TRITON_INTERPRET=1)"
        dev, size = "cuda", "quick" if args.quick else "full"
        import triton

        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows = B.indexer_suite(size, args.sweep, dev, only=args.only,
                           block_sizes=tuple(int(b) for b in args.block_sizes.split(",")))
    print()
    print(B.format_table(rows))
    for r in rows:
        if r["cfg"] is not None:
            print(f"best cfg {r['case']}: {r['cfg']}")
    print("ceilings: fp8 matmul %.0f TFLOP/s, copy %.0f GB/s (dsa.constants)" % (B.H200_FP8_FLOPS / 1e12,
                                                                                 B.H200_COPY_BYTES_PER_S / 1e9))


if __name__ == "__main__":
    main()
