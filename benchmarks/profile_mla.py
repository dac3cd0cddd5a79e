"""Run one sparse-MLA shape a few times, for Nsight Compute to profile (hardware counters).

    python benchmarks/profile_mla.py CASE          # plain run (compiles, then 2 calls)
    ncu --clock-control none -k regex:_sparse_mla_fwd --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \\
        python benchmarks/profile_mla.py CASE      # the second call's forward kernel

CASE is one of the names below (the inputs of dsa bench's rows: random index lists, all valid).
BENCHMARKS.md (2026-12-01, third session) has what these profiles showed on the H200.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import mla_inputs  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402

CASES = {  # name: (T, h_q, topk, requests, rows per request, cache format)
    "fp8_h16_b64": (64, 16, 2048, 64, 32768, "fp8_ds_mla"),
    "bf16_h16_b64": (64, 16, 2048, 64, 32768, "bf16"),
    "fp8_h128": (256, 128, 2048, 128, 32768, "fp8_ds_mla"),
    "prefill_h16": (4096, 16, 2048, 1, 131072, "bf16"),
    "prefill_h32": (4096, 32, 2048, 1, 131072, "bf16"),
    "prefill_h128": (2048, 128, 2048, 1, 131072, "bf16"),
}


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: python benchmarks/profile_mla.py {{{','.join(CASES)}}}")
    T, h, topk, nreq, s_kv, fmt = CASES[sys.argv[1]]
    q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, dev="cuda")
    flat = kv.reshape(-1, kv.shape[-1])
    for _ in range(2):
        sparse_mla_triton(q, flat, idx, 192 ** -0.5)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
