"""Run the decode indexer logits (``fp8_paged_mqa_logits``) on the benchmark's inputs a few times, for Nsight
Compute to profile (hardware counters).

    python benchmarks/profile_mqa_logits.py BLOCK_SIZE NEXT_N [in-order] [gluon:STAGES:SPAN | triton]
                                                                # plain run (compiles, then 2 calls)
    ncu --clock-control none -k "regex:_paged" --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \\
        python benchmarks/profile_mqa_logits.py 64 2     # the second call's kernel

Inputs: ``dsa bench``'s decode rows (64 requests, contexts 32K-128K, shuffled block table; ``in-order``: each
request's blocks in consecutive slots instead). The regex matches the Hopper Gluon kernel
(``_paged_logits_sm90_kernel``) and the portable one (``_paged_mqa_logits_kernel``); the default dispatch picks
between them unless ``gluon:STAGES:SPAN`` or ``triton`` is given.
BENCHMARKS.md (twelfth session) has what the profile showed on the H200.

The metrics of the memory-system table (BENCHMARKS.md, thirteenth session, call 5) are listed in
``benchmarks/profile_mla.py``.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import indexer_decode_inputs  # noqa: E402
from dsa.layouts import indexer_cache_blocks  # noqa: E402
from dsa.mqa_logits.kernel import fp8_paged_mqa_logits_triton  # noqa: E402


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: python benchmarks/profile_mqa_logits.py BLOCK_SIZE NEXT_N [in-order] "
                 "[gluon:STAGES:SPAN | triton]")
    bs, next_n = int(sys.argv[1]), int(sys.argv[2])
    g = torch.Generator(device="cuda").manual_seed(1)
    q, cache, w, ctx, bt, max_len = indexer_decode_inputs(64, 32768, 131072, bs, next_n, g, "cuda",
                                                          in_order="in-order" in sys.argv[3:])
    cfg = None
    for a in sys.argv[3:]:
        if a == "triton":
            cfg = dict(gluon=False)
        elif a.startswith("gluon:"):
            _, stages, span = a.split(":")
            cfg = dict(gluon=dict(STAGES=int(stages), SPAN=int(span)))
    blocks = indexer_cache_blocks(cache)
    out = torch.empty(64 * next_n, max_len, device="cuda")
    for _ in range(2):
        fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True, out, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
