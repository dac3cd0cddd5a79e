"""Run one sparse-MLA shape a few times, for Nsight Compute to profile (hardware counters).

    python benchmarks/profile_mla.py SHAPE [bf16] [unordered | order=VARIANT]  # plain run (compiles, then 2 calls)
    ncu --clock-control none -k "regex:_sparse_mla_(fwd|sm90)" --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio" \\
        python benchmarks/profile_mla.py SHAPE     # the second call's forward kernel

(The regex matches the Triton kernel and the Hopper Gluon one, ``_sparse_mla_sm90_kernel``, not the split merge; add
``--section SourceCounters`` for the warp-stall samples per instruction, which separate the producer
warpgroup's stalls from the math warps'.)

SHAPE is a row of `dsa bench --kernels mla` (dsa.bench.MLA_SHAPES: random index lists, all valid);
``bf16`` runs it over the bf16 cache instead; ``unordered`` without the grouping of the index lists by slot range
that many-token calls take by default (:func:`dsa.mla.kernel.order_pays`); ``order=VARIANT`` with a grouping of
``benchmarks/ab_mla_order.py`` (``off``, ``b4``, ``b8s``, ...; ``benchmarks/profile_order.py`` profiles them all). (The
2026-12-01 profiles used T 2048 for prefill h128.)
BENCHMARKS.md (2026-12-01, third session) has what these profiles showed on the H200.

Where a kernel stands against the memory system (BENCHMARKS.md, thirteenth session, call 5): replace the sections
with one ``--metrics`` argument listing, comma-separated: gpu__time_duration.sum,
sm__cycles_elapsed.avg.per_second, dram__throughput.avg.pct_of_peak_sustained_elapsed,
lts__throughput.avg.pct_of_peak_sustained_elapsed, lts__t_sector_hit_rate.pct,
l1tex__throughput.avg.pct_of_peak_sustained_active,
l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed,
smsp__issue_active.avg.pct_of_peak_sustained_active (that ncu has no sm__pipe_tensor_op_gmma_cycles_active); the
sixteenth session added dram__bytes_read.sum, lts__t_bytes.sum and lts__t_sectors_srcunit_tex.sum.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import MLA_SHAPES, mla_inputs  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_mla_order import VARIANTS, grouped_call  # noqa: E402


def main():
    opts = sys.argv[2:]
    orders = [o for o in opts if o.startswith("order=")]
    variant = orders[0][len("order="):] if orders else None
    bad_order = len(orders) > 1 or (orders and "unordered" in opts) or (variant is not None and variant not in VARIANTS)
    if len(sys.argv) < 2 or sys.argv[1] not in MLA_SHAPES or not set(opts) - set(orders) <= {"bf16", "unordered"} \
            or bad_order:
        sys.exit(f"usage: python benchmarks/profile_mla.py {{{','.join(MLA_SHAPES)}}} [bf16] "
                 f"[unordered | order={{{','.join(VARIANTS)}}}]")
    T, h, topk, nreq, s_kv, fmt = MLA_SHAPES[sys.argv[1]]
    fmt = "bf16" if "bf16" in opts else fmt  # e.g. a decode shape over the bf16 cache
    q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, dev="cuda")
    flat = kv.reshape(-1, kv.shape[-1])
    for _ in range(2):  # (unordered: without the grouping by slot range that many-token calls take by default)
        if variant is not None:
            grouped_call(q, flat, idx, 192 ** -0.5, None, *VARIANTS[variant])
        else:
            sparse_mla_triton(q, flat, idx, 192 ** -0.5, order=False if "unordered" in opts else None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
