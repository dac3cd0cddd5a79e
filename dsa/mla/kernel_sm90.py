"""Sparse MLA on Hopper (sm_90), written in Gluon; both cache formats; head groups of 64, 32 or 16.

Why a second kernel: the portable Triton kernel (:mod:`dsa.mla.kernel`) cannot place work on
warpgroups or specialise warps. For the chained QK -> PV dots of a 64-head group Triton lays the
logits over both warpgroups as ``warpsPerCTA=[8, 1]``, so each warpgroup computes the whole 64 x 64 x 576
QK product (1.5x the useful MMA work), and every warp waits for its own copies. Here:

* One program = one head group of one query token (and one split of its index list), walking the list
  in tiles of 64 gathered cache rows, one CTA per SM (160-225 KiB of shared memory).
* Warp specialisation (:func:`_producer`): a producer warpgroup (two for 16/32-head groups over the fp8_ds_mla
  cache, sharing each tile, or with 8 or more tiles per program taking alternate tiles; two on alternate tiles for
  16-head groups over the bf16 cache in launches of several waves) fills two bf16 tile
  buffers while the math warps use the other one, with two mbarriers per buffer (full, empty). bf16 cache: the
  rows are copied with ``cp.async``. fp8_ds_mla: the raw fp8 values and group scales are loaded into the
  producer's registers (``early`` of the four 128-value groups before the buffer is free) and
  dequantised once (fp8 x scale in fp32, rounded to bf16, as the Triton kernel and the reference do)
  into the buffer every product reads; the bf16 rope part by ``cp.async``. Invalid entries are
  zero-filled and masked to ``-inf`` by the math warps: NaN in unused slots cannot leak.
* 64-head groups over the bf16 cache, the default (``PINGPONG`` in :func:`_sparse_mla_sm90_kernel`, FlashMLA's
  schedule): a ping-pong of the two math warpgroups (:func:`_math_pp`). Tile ``2p`` of pair ``p`` sits in
  buffer 0 and is owned by warpgroup 0, tile ``2p + 1`` in buffer 1 by warpgroup 1. Each computes the whole
  ``S [64 heads, 64 rows]`` of its tile (m64n64: q is read once per tile, not once per 32 rows) and its
  softmax, and accumulates its own 256 of the 512 output columns over both tiles: P.V with its own P from
  registers, then with the other warpgroup's P from shared memory. One running max serves both (warpgroup 0
  publishes its max, warpgroup 1 folds it into its own and publishes the pair's max, warpgroup 0 rescales its
  P and accumulator to it). Each buffer is released in halves (values ``[0, 256)``; the rest and the rope
  part) as soon as their last reader is done, so the producer (:func:`_producer_pp`) refills one half while
  the other is still read: two buffers suffice. Unsplit launches (prefill) with h_q > 64 run persistent programs,
  one per SM (``PERSIST``): each walks its (token, head group) items, and its producer copies the next item's q (once both
  math warpgroups are past their last QK) and first tiles while the last item's P.V and output run.
* 64-head groups over the fp8_ds_mla cache (:func:`_math_64`, two math warpgroups sharing each tile; also
  bf16 with ``pingpong=False``): QK ``S [64 heads, 64 rows]`` with ``warps_per_cta=[4, 2]``, each warpgroup
  computing the logits of 32 of the 64 rows; P (bf16) to shared memory; PV ``O [64, 512]``, each warpgroup
  accumulating 256 of the 512 columns from the same tile. The ping-pong schedule leaves the producer about
  56 registers, too few for dequantising fp8 in registers (it spilled and measured 22-100% slower).
* 16/32-head groups (:func:`_math_rows`, one math warpgroup): the gathered rows are the M dimension of
  both products and the heads their N (S^T = K q^T, O^T = V^T P^T, V^T read transposed from the tile),
  so no MMA work goes to padding heads. 32-head groups take P against the earlier tiles' max (``LAZY_MAX``): the
  threads with a logit above that max by more than ``LAZY_TAU`` tag a shared word before the barrier that follows
  the P store, one load past it decides, and only then are the maxima exchanged, P redone and the accumulator
  rescaled (3-4% faster at batch 64-128 and in prefill; no gain at 16 heads, where the producers' fill sets the
  time per tile). Two math warpgroups splitting the output columns were
  measured slower (BENCHMARKS.md).
* Shared memory against L1: one CTA per SM, and the driver is asked for the smallest carveout that holds it
  (:func:`_prefer_l1`), so the rest (60 KiB for 16/32-head groups) is L1, which the fp8 producer's row loads go
  through.
* Online softmax in fp32 with exp2, the same epilogue as the Triton kernel (:func:`_epilogue`; partials for
  split-K).
* Split-K merged inside the kernel (``CLUSTER``; :func:`dsa.mla.kernel.cluster_size` decides when): the splits
  of one (token, head group) run as one cluster of CTAs, which are scheduled together. Each stores its fp32
  partials, all meet at the cluster barrier (``barrier.cluster``, release/acquire), then each merges a slice of
  the output columns from the partials in L2 (:func:`_cluster_merge`): no second launch, which costs 2-4 us at
  batch 1. The clusters are launched by giving the compiled variant a cluster size in its launch metadata
  (:class:`_ClusterJITFunction`), not by Triton's ``num_ctas``, which would also spread every layout over the
  CTAs.

What bounds it, and what was tried: BENCHMARKS.md ("Where each goal stands"; every idea measured and not kept, with
its numbers and session, in "Sparse MLA: ideas measured and not kept"). In short, for small-head fp8 decode: per
64-row tile of a 16-head group about 290 KB pass through the SM's shared-memory path (128 bytes per clock): the raw
rows through L1, the bf16 tile stored, and both products' operands, since a wgmma with A in shared memory and N of
16-32 is bound by that path (an m64n16k16 takes 21.6 clocks, 37% of the tensor peak: ``benchmarks/mma_small_n.py``).
That is about 2,260 clocks (2,300-2,700 counted for 32 heads), as long as the tile's share of DRAM at 4.3 TB/s,
while the math warpgroup's serial chain (QK, softmax, P.V) takes about 3,700 clocks per tile at 16 heads and 4,400
at 32, and with two tile buffers neither it nor the producers' fill can run ahead. Kernels with no bf16 tile, their
operands converted in registers from the raw rows, move far less through that path: :mod:`dsa.mla.kernel_bulk`
(mma.sync on a ring of bulk row copies) is one, and serves 1-16-head fp8 decode from batch 32; its row copies alone
take most of its time, and its math, not wholly hidden behind them, is bound by per-sub-partition pipe throughput.

Gluon kernels do not run under ``TRITON_INTERPRET``: these are tested on the GPU against the reference
and against the Triton kernel (tests/test_mla.py, ``test_gpu_sm90_*``); the CPU CI tests the Triton
kernel, which stays the path everywhere else.
"""
from __future__ import annotations

import ctypes
import functools
import warnings

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon._runtime import GluonJITFunction  # (Triton 3.6: the class gluon.jit builds)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .epilogue import merge_weights, row_stats

BLOCK_H = 64
BLOCK_N = 64
PRODUCER_WARPS = 4
#: producer warpgroup registers and fp8 groups loaded before the buffer is free, per cache format (the math
#: warps get the rest of the register file). Measured on the H200 (BENCHMARKS.md): fp8 decode h_q 128 at batch
#: 128 x s_q 2 471 us with these against 519 us with the bf16 setting; bf16 prefill h_q 128 5.99 against 6.19 ms.
PRODUCER = {False: dict(regs=96, early=2), True: dict(regs=120, early=4)}  # keyed by "fp8_ds_mla"
#: the producer of 16/32-head groups over the fp8_ds_mla cache: two warpgroups (``warps``) sharing each tile's rows.
#: With one math warpgroup the register file has room for them. H200, CUDA graphs, s_q 1, 32K (BENCHMARKS.md):
#: h_q 32 batch 64 65.2 -> 60.9 us, batch 128 110.1 -> 105.0, batch 1 10.2 -> 9.6; h_q 16 batch 64 56.6 -> 56.2.
#: From ``alt`` tiles per program on (0: never) the two warpgroups fill alternate tiles instead, each loading a whole
#: tile into its registers while the other dequantises its own (:func:`_producer`, :func:`alternate_tiles`). Shared
#: tiles -> alternate tiles: h_q 16 batch 32 / 64 / 128 (8 / 16 / 32 tiles per program) 30.7 / 50.1 / 88.9 -> 27.2 /
#: 41.9 / 70.6, h_q 32 35.1 / 56.8 / 96.4 -> 31.8 / 49.9 / 83.4; but h_q 16 batch 16 (4 tiles) 17.4 -> 17.9 and
#: batch 1 (2 tiles) 9.4 -> 10.2. (bf16: no gain, batch 32 29.8 -> 30.4.)
PRODUCER_ROWS_FP8 = dict(regs=120, early=4, warps=8, alt=8)
#: 16-head groups over the bf16 cache in launches of more CTAs than SMs (several waves: prefill, decode past about
#: 132 tokens) take two producer warpgroups on alternate tiles as well: one warpgroup waits for a tile's copies to
#: land before it issues the next tile's, two keep both buffers' copies in flight. H100, topk 2048, medians of 5
#: interleaved rounds (BENCHMARKS.md, seventy-third session): prefill over 128K rows T 256 / 512 / 1024 / 4096 183.3 /
#: 260.3 / 498.1 / 1919.3 -> 180.2 / 253.3 / 483.9 / 1878.5 us; decode (CUDA graphs) batch 256 (32K) 212.9 -> 211.4,
#: 512 (16K) 414.2 -> 410.0. Not in one wave (batch 32 / 64 / 128 36.4 / 61.5 / 109.0 -> 37.4 / 62.6 / 109.9) nor
#: for 32-head groups (prefill 2054.6 -> 2061.0, batch 64 65.8 -> 67.2).
PRODUCER_ROWS_BF16_WAVES = dict(warps=8, alt=1)
#: the head-group sizes (``block_h``) whose math warpgroup takes P against the earlier tiles' max, one barrier round
#: per tile (:func:`_math_rows`, ``LAZY``), and how far a tile's max may exceed it (log2 units) before P is redone
#: against the new max. H200, CUDA graphs, s_q 1, 32K, 3 rounds (BENCHMARKS.md): 32-head groups fp8 batch 64 / 128
#: 49.8 / 87.2 -> 48.0 / 84.1 us, bf16 prefill h_q 32 2115 -> 2040 us; 16-head groups within +-1% (batch 1 +1.1%),
#: so left out: there the producers' fill, not the softmax, sets the time per tile.
LAZY_MAX = (32,)
LAZY_TAU = gl.constexpr(8.0)
#: the ping-pong schedule for 64-head groups over the bf16 cache (:func:`_math_pp`, :func:`_producer_pp`) by default,
#: and its registers: producer warpgroup and the worker math warpgroup (the default one gets the rest, 240;
#: no spills at these, sm_90 compile)
PINGPONG = True
PRODUCER_PP = dict(regs=56, math_regs=208)
#: unsplit ping-pong launches (prefill) with two or more 64-head groups per token (h_q > 64) run one persistent
#: program per SM over the work items, (token, head group) pairs (``PERSIST``: :func:`_math_pp_persist`,
#: :func:`_producer_pp_persist`): the next item's q and first tiles are copied by the producer while the last item's
#: P.V and output run. H200, bf16 prefill, 4096 tokens x topk 2048, do_bench medians of 3-5 interleaved rounds in five
#: runs (BENCHMARKS.md): h_q 128 -3.3 to -3.6% (443.8 -> 459.0, 453.2 -> 469.8 TFLOP/s), a causal h_q 128 prefill
#: -3.0 to -3.6%, 1024 tokens -3.0 to -4.5%; but h_q 64 (one group per token) +1.9, +2.0, -2.2, +2.6, +4.8%: not there.
PERSIST = True


@gluon.jit
def _tile_idx(idx_row, n0, stop, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Index-list entries ``[n0, n0 + BLOCK_N)`` as loaded, -1 from ``stop`` on (so :func:`_idx_valid` is the
    whole test). The math warpgroups load the next tile's entries behind this tile's P.V and test them after the
    next QK: loaded at the tile's own top, their test right after the ``full`` wait stalled every tile for a
    global round trip (about 590 of a 32-head prefill tile's 3,200 clocks on an H100; BENCHMARKS.md, seventieth
    session). A persistent ping-pong program has no registers to spare for them and loads its own late."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout)
    return gl.load(idx_row + offs_n, mask=offs_n < stop, other=-1)


@gluon.jit
def _idx_valid(idx, S):
    return (idx >= 0) & (idx < S)


@gluon.jit
def _tile_rows(idx_row, n0, stop, S, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Index-list entries ``[n0, n0 + BLOCK_N)`` as (valid, int64 row) vectors in ``layout``."""
    idx = _tile_idx(idx_row, n0, stop, BLOCK_N, layout)
    valid = _idx_valid(idx, S)
    return valid, gl.where(valid, idx, 0).to(gl.int64)


@gluon.jit
def _issue_tile(nope_smem, rope_smem, nope_ptr, stride_nope, rope_ptr, stride_rope, valid, rows,
                DV: gl.constexpr, DR: gl.constexpr, cp_l: gl.constexpr):
    """cp.async the gathered rows into one buffer (zero-filled where invalid)."""
    cols = gl.arange(0, DV, gl.SliceLayout(0, cp_l))
    # row offsets: multiples of 16 bytes (the launcher checks the strides)
    cp.async_copy_global_to_shared(nope_smem, nope_ptr + gl.multiple_of(rows * stride_nope, 8)[:, None] + cols[None, :],
                                   mask=valid[:, None])
    cols_r = gl.arange(0, DR, gl.SliceLayout(0, cp_l))
    cp.async_copy_global_to_shared(rope_smem, rope_ptr + gl.multiple_of(rows * stride_rope, 8)[:, None] + cols_r[None, :],
                                   mask=valid[:, None])
    cp.commit_group()


@gluon.jit
def _span(len_ptr, t, sid, topk, split_len, BN: gl.constexpr, HAS_LEN: gl.constexpr):
    """This program's part of the token's index list: ``[start, stop)`` and its number of tiles."""
    end = topk
    if HAS_LEN:
        end = gl.minimum(end, gl.load(len_ptr + t))
    start = sid * split_len
    stop = gl.minimum(start + split_len, end)
    return start, stop, gl.cdiv(gl.maximum(stop - start, 0), BN)


@gluon.jit
def _load_q(q_nope_smem, q_rope_smem, q_ptr, stride_qt, stride_qh, t64, hg, h_q, BH: gl.constexpr, DV: gl.constexpr,
            DR: gl.constexpr, cp_l: gl.constexpr):
    """The head group's q rows (plain loads; heads past h_q are zero) into shared memory."""
    offs_hq = hg * BH + gl.arange(0, BH, gl.SliceLayout(1, cp_l))
    q_row = q_ptr + t64 * stride_qt + offs_hq[:, None] * stride_qh
    q_mask = (offs_hq < h_q)[:, None]
    q_nope_smem.store(gl.load(q_row + gl.arange(0, DV, gl.SliceLayout(0, cp_l))[None, :], mask=q_mask, other=0.0))
    q_rope_smem.store(gl.load(q_row + DV + gl.arange(0, DR, gl.SliceLayout(0, cp_l))[None, :], mask=q_mask, other=0.0))


@gluon.jit
def _token_group(h_q, BH: gl.constexpr, CLUSTER: gl.constexpr):
    """This program's token, head group (of ``BH`` heads) and split: ``(t, t64, hg, sid)``. ``CLUSTER``: the
    splits of one (token, head group) are the ``CLUSTER`` CTAs of one cluster (program axis 0, rank = split)."""
    pid = gl.program_id(0)
    if CLUSTER > 1:
        sid = pid % CLUSTER
        pid = pid // CLUSTER
    else:
        sid = gl.program_id(1)
    n_hg = gl.cdiv(h_q, BH)
    t = pid // n_hg
    return t, t.to(gl.int64), pid % n_hg, sid


@gluon.jit
def _cluster_barrier(NW: gl.constexpr, WAIT: gl.constexpr):
    """``barrier.cluster``: every thread of these ``NW`` warps arrives, with release semantics (its global
    stores before this point are visible to every CTA of the cluster past the wait); ``WAIT``: and waits
    until every non-exited thread of the cluster has arrived (acquire)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    one_per_thread = gl.full([32 * NW], 0, gl.int32, lay)
    # (launched without a cluster, ptxas makes the wait a barrier of the whole CTA, which the parked worker warps
    # never reach: a hang. Hence the check after the launch in :func:`launch`.)
    if WAIT:
        asm: gl.constexpr = "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\nmov.u32 $0, $1;"
    else:
        asm: gl.constexpr = "barrier.cluster.arrive.release.aligned;\nmov.u32 $0, $1;"
    gl.inline_asm_elementwise(asm, "=r,r", [one_per_thread], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _cluster_merge(o_part_ptr, lse_part_ptr, ml_part_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, ml_ptr, lse_ptr,
                   t64, hg, sid, T, h_q, BH: gl.constexpr, NS: gl.constexpr, HAS_SINK: gl.constexpr,
                   NW: gl.constexpr):
    """The split merge inside the kernel (after the cluster barrier): the CTA of split ``sid`` merges output
    columns ``[sid * 512 / NS, (sid + 1) * 512 / NS)`` of its head group from the ``NS`` fp32 partials (``[NS,
    T, h_q, 512]``, lse and max ``[NS, T, h_q]`` in log2 units, written by the cluster's CTAs), the same
    arithmetic as :func:`dsa.mla.kernel._sparse_mla_combine_kernel` (:func:`~dsa.mla.epilogue.merge_weights`);
    split 0 also writes lse and max_logits. Heads in rounds of ``HB`` (each loads its lse and partials
    together: one memory round trip; at most 64 partial values per thread, 32 for 64-head groups: more made
    the math partitions spill, sm_90 compile)."""
    LN2: gl.constexpr = 0.6931471805599453
    D: gl.constexpr = 512
    DC: gl.constexpr = D // NS
    HB: gl.constexpr = 4 * NW if BH < 64 else 2 * NW  # (more spilled registers in the partitions)
    TD: gl.constexpr = DC // 4 if DC < 128 else 32
    l3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // TD, TD], [1, NW, 1], [2, 1, 0])
    sh_l: gl.constexpr = gl.SliceLayout(2, l3)  # [NS, HB]
    o_l: gl.constexpr = gl.SliceLayout(0, l3)  # [HB, DC]
    offs_s = gl.arange(0, NS, gl.SliceLayout(1, sh_l))
    offs_d = sid * DC + gl.arange(0, DC, gl.SliceLayout(0, o_l))
    for h0 in gl.static_range(0, BH, HB):
        offs_h = hg * BH + h0 + gl.arange(0, HB, gl.SliceLayout(0, sh_l))
        hmask = offs_h < h_q
        part = (offs_s[:, None].to(gl.int64) * T + t64) * h_q + offs_h[None, :]
        pmask = (offs_s[:, None] < NS) & hmask[None, :]
        lse_s = gl.load(lse_part_ptr + part, mask=pmask, other=float("-inf"), cache_modifier=".cg")
        o_all = gl.load(o_part_ptr + gl.expand_dims(part * D, 2) + gl.expand_dims(gl.expand_dims(offs_d, 0), 0),
                        mask=gl.expand_dims(pmask, 2), other=0.0, cache_modifier=".cg")
        w_s, m_use, inv, lse, empty = merge_weights(lse_s, sink_ptr, offs_h, hmask, HAS_SINK)
        acc = gl.sum(gl.expand_dims(w_s, 2) * o_all, 0)
        offs_ho = gl.convert_layout(offs_h, gl.SliceLayout(1, o_l))
        o_ptrs = out_ptr + t64 * stride_ot + offs_ho[:, None] * stride_oh + offs_d[None, :]
        gl.store(o_ptrs, (acc * gl.convert_layout(inv, gl.SliceLayout(1, o_l))[:, None]).to(gl.bfloat16),
                 mask=(offs_ho < h_q)[:, None])
        if sid == 0:
            ml_s = gl.load(ml_part_ptr + part, mask=pmask, other=float("-inf"), cache_modifier=".cg")
            gl.store(lse_ptr + t64 * h_q + offs_h, lse, mask=hmask)
            gl.store(ml_ptr + t64 * h_q + offs_h, gl.where(empty, float("-inf"), gl.max(ml_s, 0) * LN2), mask=hmask)


@gluon.jit
def _epilogue(acc, l_i, m_i, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr, t64, hg, sid, T,
              h_q, BH: gl.constexpr, D0: gl.constexpr, HEAD_AXIS: gl.constexpr, o_layout: gl.constexpr,
              HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, STATS: gl.constexpr, m_top=None):
    """Normalise and store the accumulator of a head group: ``acc`` holds output columns ``[D0, D0 + DW)`` of
    the ``BH`` heads, as ``[BH, DW]`` (``HEAD_AXIS`` 0) or transposed ``[DW, BH]`` (1), fp32 in ``o_layout``;
    ``l_i`` / ``m_i`` the running sum and max per head (log2 units, any layout). ``SPLIT``: fp32 partials of split
    ``sid``. ``STATS``: also store lse and max_logits (:func:`~dsa.mla.epilogue.row_stats`). ``m_top``: the true
    running max when ``m_i`` is only the reference ``acc`` and ``l_i`` were taken against (``LAZY``)."""
    head_l: gl.constexpr = gl.SliceLayout(1 - HEAD_AXIS, o_layout)
    DW: gl.constexpr = acc.shape[1 - HEAD_AXIS]
    offs_h = hg * BH + gl.arange(0, BH, head_l)
    hmask = offs_h < h_q
    offs_d = D0 + gl.arange(0, DW, gl.SliceLayout(HEAD_AXIS, o_layout))
    if m_top is not None:
        m_top = gl.convert_layout(m_top, head_l)
    inv, lse, ml = row_stats(gl.convert_layout(l_i, head_l), gl.convert_layout(m_i, head_l), sink_ptr, offs_h, hmask,
                             HAS_SINK, SPLIT, m_top)
    mask = gl.expand_dims(hmask, 1 - HEAD_AXIS)
    cols = gl.expand_dims(offs_d, HEAD_AXIS)
    if SPLIT:
        o_ptrs = out_ptr + sid.to(gl.int64) * stride_os + t64 * stride_ot + gl.expand_dims(offs_h, 1 - HEAD_AXIS) * stride_oh
        ml_off = (sid.to(gl.int64) * T + t64) * h_q + offs_h
        gl.store(o_ptrs + cols, acc * gl.expand_dims(inv, 1 - HEAD_AXIS), mask=mask)
    else:
        o_ptrs = out_ptr + t64 * stride_ot + gl.expand_dims(offs_h, 1 - HEAD_AXIS) * stride_oh
        ml_off = t64 * h_q + offs_h
        gl.store(o_ptrs + cols, (acc * gl.expand_dims(inv, 1 - HEAD_AXIS)).to(gl.bfloat16), mask=mask)
    if STATS:
        gl.store(lse_ptr + ml_off, lse, mask=hmask)
        gl.store(ml_ptr + ml_off, ml, mask=hmask)


@gluon.jit
def _producer(k_nope_smem, k_rope_smem, full, empty, nope_ptr, stride_nope, scale_ptr, stride_scale, rope_ptr,
              stride_rope, idx_row, start, n_tiles, stop, S, IS_FP8: gl.constexpr, PW: gl.constexpr,
              EARLY: gl.constexpr, CLUSTER: gl.constexpr, PAR: gl.constexpr = 0, STEP: gl.constexpr = 1):
    """Producer warpgroup: for each tile, wait until the math warps have released its buffer (``empty``),
    fill it (bf16: ``cp.async`` of the gathered rows; fp8_ds_mla: the raw values and scales loaded into
    registers *before* that wait, then dequantised (fp8 x group scale in fp32, rounded to bf16) into the
    buffer, the rope part by ``cp.async``), make it visible to wgmma and signal ``full``. Invalid entries
    are zero-filled and masked by the math warps: NaN in unused slots cannot leak. ``PW`` warps fill each tile;
    with ``STEP`` 2 this warpgroup fills only the tiles ``PAR, PAR + 2, ...`` (always buffer ``PAR``) and another
    one the others, so one loads while the other dequantises."""
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])  # 16-byte pieces
    # fp8: 16 values per thread. With two producer warpgroups (16/32-head groups, sharing tiles or on alternate
    # ones; the latter measured only this way) 4 threads share a row, so a quarter-warp's bf16 stores cover two rows
    # of the swizzled tile, with different swizzle phases (H200, CUDA graphs, shared tiles: h_q 16 batch 64 52.5 ->
    # 50.3 us, batch 32 31.3 -> 30.6; h_q 32 within 1%); one warpgroup (64-head groups) keeps 8 threads per row (4
    # was 9% slower there: fp8 h_q 128 batch 128 x s_q 2 468.8 -> 510.5 us)
    TPR: gl.constexpr = 4 if PW == 8 or STEP == 2 else 8
    # fp8 on every tile (STEP 1): the next tile's index-list entries are loaded only after ``full`` is signalled (the
    # fence before it is a membar, which waits for this thread's outstanding loads; ptxas puts the load a few hundred
    # instructions before it). Measured on the H200, CUDA graphs, s_q 1 unless noted: h_q 16 batch 1 / 4 / 8 / 16 9.4 /
    # 9.7 / 11.0 / 15.6 -> 9.1 / 9.3 / 10.8 / 15.5 us, h_q 32 9.5 / 11.0 / 13.8 / 19.1 -> 9.2 / 10.8 / 13.6 / 18.7, h_q
    # 128 batch 1 x s_q 2 16.4 -> 16.2, batch 128 x s_q 2 468 -> 467. Not on alternate tiles (the loop top waits for
    # them at once: h_q 16 batch 64 42.0 -> 43.2) nor for bf16 (its copies: h_q 16 batch 64 44.9 -> 47.6).
    LATE: gl.constexpr = IS_FP8 and STEP == 1
    cp8_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPR, TPR], [PW, 1], [1, 0])
    if IS_FP8:
        row_l: gl.constexpr = gl.SliceLayout(1, cp8_l)
        cols = gl.arange(0, 128, gl.SliceLayout(0, cp8_l))
    else:
        row_l: gl.constexpr = gl.SliceLayout(1, cp_l)
    valid, rows = _tile_rows(idx_row, start + PAR * BN, stop, S, BN, row_l)
    for i in range(PAR, n_tiles, STEP):
        s = i % 2
        if IS_FP8:  # EARLY (2 or 4) of the four raw groups loaded before the wait, the rest while storing
            base = nope_ptr + gl.multiple_of(rows * stride_nope, 16)[:, None] + cols[None, :]
            m = valid[:, None]
            sb = scale_ptr + rows * stride_scale
            r0 = gl.load(base + 0 * 128, mask=m, other=0.0)
            r1 = gl.load(base + 1 * 128, mask=m, other=0.0)
            s0 = gl.load(sb + 0, mask=valid, other=0.0)
            s1 = gl.load(sb + 1, mask=valid, other=0.0)
            if EARLY == 4:
                r2 = gl.load(base + 2 * 128, mask=m, other=0.0)
                r3 = gl.load(base + 3 * 128, mask=m, other=0.0)
                s2 = gl.load(sb + 2, mask=valid, other=0.0)
                s3 = gl.load(sb + 3, mask=valid, other=0.0)
        mbarrier.wait(empty.index(s), ((i // 2) & 1) ^ 1)
        if IS_FP8:
            valid_r = gl.convert_layout(valid, gl.SliceLayout(1, cp_l))
            rows_r = gl.convert_layout(rows, gl.SliceLayout(1, cp_l))
            cols_r = gl.arange(0, DR, gl.SliceLayout(0, cp_l))
            cp.async_copy_global_to_shared(k_rope_smem.index(s), rope_ptr + gl.multiple_of(rows_r * stride_rope, 8)[:, None]
                                           + cols_r[None, :], mask=valid_r[:, None])
            cp.commit_group()
            kn = k_nope_smem.index(s)
            if EARLY != 4:
                r2 = gl.load(base + 2 * 128, mask=m, other=0.0)
                s2 = gl.load(sb + 2, mask=valid, other=0.0)
            kn.slice(0 * 128, 128, dim=1).store((r0.to(gl.float32) * s0[:, None]).to(gl.bfloat16))
            if EARLY != 4:
                r3 = gl.load(base + 3 * 128, mask=m, other=0.0)
                s3 = gl.load(sb + 3, mask=valid, other=0.0)
            kn.slice(1 * 128, 128, dim=1).store((r1.to(gl.float32) * s1[:, None]).to(gl.bfloat16))
            kn.slice(2 * 128, 128, dim=1).store((r2.to(gl.float32) * s2[:, None]).to(gl.bfloat16))
            kn.slice(3 * 128, 128, dim=1).store((r3.to(gl.float32) * s3[:, None]).to(gl.bfloat16))
        else:
            _issue_tile(k_nope_smem.index(s), k_rope_smem.index(s), nope_ptr, stride_nope, rope_ptr, stride_rope, valid,
                        rows, DV, DR, cp_l)
        if not LATE:
            valid, rows = _tile_rows(idx_row, start + (i + STEP) * BN, stop, S, BN, row_l)  # the next tile's indices
        cp.wait_group(0)  # this thread's copies of the tile have landed
        fence_async_shared()
        gl.thread_barrier()  # every producer thread's part is in (the producer warps only)
        mbarrier.arrive(full.index(s))
        if LATE:
            valid, rows = _tile_rows(idx_row, start + (i + STEP) * BN, stop, S, BN, row_l)
    if CLUSTER > 1:  # the producer's part of the cluster barrier before the in-kernel merge
        _cluster_barrier(PW, False)


@gluon.jit
def _softmax_step(sc, valid, m_i, l_2d, sm_scale_log2, HEAD_AXIS: gl.constexpr):
    """One tile of the online softmax (log2 units) on the raw logits ``sc``, ``[heads, rows]`` (``HEAD_AXIS`` 0)
    or ``[rows, heads]`` (1): invalid rows to ``-inf``, the new running max ``m_i``, the rescale factor of the
    earlier tiles ``alpha``, ``P`` and the per-element partial sums ``l_2d`` (reduced over the rows at the
    end). Returns ``(p, alpha, l_2d, m_i)``."""
    ROW_AXIS: gl.constexpr = 1 - HEAD_AXIS
    sc = gl.where(gl.expand_dims(valid, HEAD_AXIS), sc * sm_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, ROW_AXIS))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(sc - gl.expand_dims(m_use, ROW_AXIS))
    return p, alpha, l_2d * gl.expand_dims(alpha, ROW_AXIS) + p, m_new


@gluon.jit
def _math_64(q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p_smem, full, empty, q_ptr, stride_qt, stride_qh,
             idx_row, len_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr, t, t64, hg, sid,
             T, h_q, S, start, stop, n_tiles, sm_scale_log2, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr):
    """The two math warpgroups (the default partition): q into shared memory, then per tile wait for
    ``full``, QK (each warpgroup 32 of the 64 rows), online softmax, P to shared memory, P.V (each
    warpgroup 256 of the 512 columns), release the buffer (``empty``); the epilogue at the end."""
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    _load_q(q_nope_smem, q_rope_smem, q_ptr, stride_qt, stride_qh, t64, hg, h_q, BH, DV, DR, cp_l)
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_2d = gl.zeros([BH, BN], gl.float32, s_layout)
    acc = gl.zeros([BH, DV], gl.float32, o_layout)
    s_zero = gl.zeros([BH, BN], gl.float32, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    idx_t = _tile_idx(idx_row, start, stop, BN, col_l)
    for i in range(n_tiles):
        s = i % 2
        mbarrier.wait(full.index(s), (i // 2) & 1)
        kn = k_nope_smem.index(s)
        sc = warpgroup_mma(q_rope_smem, k_rope_smem.index(s).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(q_nope_smem, kn.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))

        p, alpha, l_2d, m_i = _softmax_step(sc, _idx_valid(idx_t, S), m_i, l_2d, sm_scale_log2, 0)

        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        acc = warpgroup_mma(p_smem, kn.slice(0, DV, dim=1), acc * alpha_o[:, None], is_async=True)
        idx_t = _tile_idx(idx_row, start + (i + 1) * BN, stop, BN, col_l)  # the next tile's (behind this P.V)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()  # both warpgroups are done with the buffer and with P (one thread signals for all)
        mbarrier.arrive(empty.index(s))

    _epilogue(acc, gl.sum(l_2d, 1), m_i, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr, t64, hg,
              sid, T, h_q, BH, 0, 0, o_layout, HAS_SINK, SPLIT, True)


@gluon.jit
def _grow_init():
    """Declare and zero the lazy softmax's growth word (:func:`_math_rows`; each thread of the math warpgroup stores
    0, a barrier must follow): a static shared array of the kernel's own, which inline assembly can name (Gluon's
    buffers have no address it can take). 1 KB, so that the dynamic shared memory after it stays 1024-byte aligned,
    as its swizzled tiles need."""
    gl.inline_asm_elementwise(".shared .align 1024 .b8 dsa_grow[1024]; st.shared.u32 [dsa_grow], 0; mov.u32 $0, 0;",
                              "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _grow_put(pred, tag, BH: gl.constexpr):
    """``[64, BH]`` booleans in the 64-row wgmma accumulator layout (thread ``l`` of warp ``w`` holds rows ``16 w +
    l // 4`` and ``16 w + 8 + l // 4``, columns ``8 j + 2 (l % 4) + c``): each thread ORs its own values (no data
    crosses threads) and, where any is set, stores ``tag`` (int32, the same in every thread) to the growth word."""
    x = gl.reshape(pred.to(gl.int32), [4, 2, 8, BH // 8, 4, 2])
    x = gl.max(gl.max(gl.max(x, 5), 3), 1)  # [4, 8, 4]: warp, l // 4, l % 4
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $1, 0; @p st.shared.u32 [dsa_grow], $2; }"
                              " mov.u32 $0, 0;", "=r,r,r", [x, tag], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _grow_get(tag):
    """Whether the growth word holds ``tag`` (int32 scalar, 1 or 0): one shared load, the same word in every
    thread."""
    return gl.inline_asm_elementwise("{ .reg .u32 v; .reg .pred p; ld.shared.u32 v, [dsa_grow]; setp.eq.u32 p, v, $1;"
                                     " selp.u32 $0, 1, 0, p; }", "=r,r", [tag], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _math_rows(q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p_smem, full, empty, q_ptr, stride_qt,
                  stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr, t64, hg,
                  sid, T, h_q, S, start, stop, n_tiles, sm_scale_log2, BH: gl.constexpr, HAS_SINK: gl.constexpr,
                  SPLIT: gl.constexpr, m_smem=None, LAZY: gl.constexpr = False):
    """The math warpgroup of a 16/32-head group (the default partition): the gathered rows are the M
    dimension of both products and the heads their N (S^T = K q^T, O^T = V^T P^T), so no MMA work is spent
    on padding heads; per tile wait for ``full``, the two products and the online softmax, release the
    buffer (``empty``); the epilogue at the end.

    ``LAZY``: P is taken against the reference max of the earlier tiles, not this tile's. Before the P store's
    barrier each thread with a logit above the reference by more than ``LAZY_TAU`` stores the tile's tag (``i +
    1``) to the growth word (:func:`_grow_put`); past it one shared load decides (:func:`_grow_get`): a tag from
    an earlier tile means no growth, so the word is never cleared. Only on growth (and at the first valid tile)
    do the warps exchange their maxima through ``m_smem`` and redo P, the sums and the accumulator against the
    new max. P is then at most ``2**LAZY_TAU``, exact enough in bf16; lse is the reference plus log2 of the sum,
    exact for any reference; max_logits comes from the true running max, which each thread keeps for its own two
    rows until the epilogue. (The word is addressed by name in inline assembly: a Gluon load of words that every
    thread reads, or ``%tid`` read in the loop, made ptxas keep the wgmma descriptors out of uniform registers
    and spill 160-272 bytes.)"""
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    _load_q(q_nope_smem, q_rope_smem, q_ptr, stride_qt, stride_qh, t64, hg, h_q, BH, DV, DR, cp_l)
    if LAZY:
        _grow_init()
    fence_async_shared()
    gl.thread_barrier()

    head_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_i = gl.full([BH], float("-inf"), gl.float32, head_s)
    l_2d = gl.zeros([BN, BH], gl.float32, s_layout)  # per-row partial sums, reduced over the rows at the end
    acc = gl.zeros([DV, BH], gl.float32, o_layout)  # O^T
    s_zero = gl.zeros([BN, BH], gl.float32, s_layout)
    # LAZY: the true running max (m_i is the reference), each thread's of its own two rows until the epilogue
    m_top = gl.max(gl.reshape(gl.full([BN, BH], float("-inf"), gl.float32, s_layout), [4, 2, 8, BH]), 1)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    idx_t = _tile_idx(idx_row, start, stop, BN, row_l)
    for i in range(n_tiles):
        s = i % 2
        mbarrier.wait(full.index(s), (i // 2) & 1)
        kn = k_nope_smem.index(s)
        sc = warpgroup_mma(k_rope_smem.index(s), q_rope_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        sc = warpgroup_mma(kn, q_nope_smem.permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))

        if LAZY:
            sc = gl.where(gl.expand_dims(_idx_valid(idx_t, S), 1), sc * sm_scale_log2, float("-inf"))
            m_top = gl.maximum(m_top, gl.max(gl.reshape(sc, [4, 2, 8, BH]), 1))  # each thread its own rows'
            ref = gl.where(m_i == float("-inf"), float("inf"), m_i)  # nothing valid yet: P 0 until the redo
            p = gl.exp2(sc - gl.expand_dims(ref, 0))
            # does any logit exceed the reference by more than LAZY_TAU? Those threads tag the growth word with i + 1
            tag = (i + 1).to(gl.int32)
            _grow_put(sc > gl.expand_dims(m_i + LAZY_TAU, 0), tag, BH)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            if _grow_get(tag) != 0:
                m_smem.slice(0, BH, dim=1).store(gl.max(gl.reshape(sc, [4, BN // 4, BH]), axis=1))  # warp w's rows
                gl.thread_barrier()
                m1 = m_smem._reinterpret(gl.float32, [4 * 32], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
                m_t = gl.maximum(gl.maximum(m1.slice(0, BH).load(head_s), m1.slice(32, BH).load(head_s)),
                                 gl.maximum(m1.slice(64, BH).load(head_s), m1.slice(96, BH).load(head_s)))
                m_new = gl.maximum(m_i, m_t)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = gl.exp2(m_i - m_use)
                p = gl.exp2(sc - gl.expand_dims(m_use, 0))
                l_2d = l_2d * gl.expand_dims(alpha, 0) + p
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))[None, :]
                p_smem.store(p.to(gl.bfloat16))
                fence_async_shared()
                gl.thread_barrier()
                m_i = m_new
                p = s_zero  # (summed already)
            acc = warpgroup_mma(kn.slice(0, DV, dim=1).permute((1, 0)), p_smem, acc, is_async=True)
            l_2d = l_2d + p  # this tile's P where it did not grow, behind the P.V issue
        else:
            p, alpha, l_2d, m_i = _softmax_step(sc, _idx_valid(idx_t, S), m_i, l_2d, sm_scale_log2, 1)

            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))
            acc = warpgroup_mma(kn.slice(0, DV, dim=1).permute((1, 0)), p_smem, acc * alpha_o[None, :], is_async=True)
        idx_t = _tile_idx(idx_row, start + (i + 1) * BN, stop, BN, row_l)  # the next tile's (behind this P.V)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()  # every warp is done with the buffer and with P (one thread signals for all)
        mbarrier.arrive(empty.index(s))

    l_i = gl.sum(l_2d, 0)
    _epilogue(acc, l_i, m_i, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr, t64, hg,
              sid, T, h_q, BH, 0, 1, o_layout, HAS_SINK, SPLIT, True, gl.max(gl.max(m_top, 1), 0) if LAZY else None)


# ------------------------------------------------------------------------------------------------------
# 64-head groups, ping-pong: the two math warpgroups own alternate tiles (pairs of tiles per step)
# ------------------------------------------------------------------------------------------------------
@gluon.jit
def _pp_copy_bf16(kn, kr, nope_ptr, stride_nope, rope_ptr, stride_rope, valid, rows, HALF: gl.constexpr,
                  cp_l: gl.constexpr):
    """cp.async one half of a gathered bf16 tile: HALF 0 the values ``[0, 256)``, HALF 1 ``[256, 512)`` and
    the rope part (zero-filled where invalid)."""
    cols = gl.arange(0, 256, gl.SliceLayout(0, cp_l))
    base = gl.multiple_of(rows * stride_nope, 8)[:, None]
    cp.async_copy_global_to_shared(kn.slice(HALF * 256, 256, dim=1), nope_ptr + base + HALF * 256 + cols[None, :],
                                   mask=valid[:, None])
    if HALF == 1:
        cols_r = gl.arange(0, 64, gl.SliceLayout(0, cp_l))
        cp.async_copy_global_to_shared(kr, rope_ptr + gl.multiple_of(rows * stride_rope, 8)[:, None] + cols_r[None, :],
                                       mask=valid[:, None])
    cp.commit_group()


@gluon.jit
def _pp_ready(bar):
    """The producer's copies of a half tile have landed: make them visible to wgmma and signal ``bar``."""
    fence_async_shared()
    _signal(bar)


@gluon.jit
def _producer_pp(k_nope_smem, k_rope_smem, ready, free, nope_ptr, stride_nope, rope_ptr, stride_rope, idx_row, start,
                 n_pairs, stop, S, gp, PW: gl.constexpr, CLUSTER: gl.constexpr):
    """Producer of the ping-pong schedule (bf16 cache): tile ``2p`` of pair ``p`` goes to buffer 0, tile ``2p + 1``
    to buffer 1, each in two halves (L: values ``[0, 256)``; R: ``[256, 512)`` and the rope part) with their own
    ``ready`` / ``free`` mbarriers (index ``2 * buffer + half``), copied by ``cp.async`` in the order the math
    warpgroups free them: 0L, 1R, 0R, 1L (each half is issued before the previous one is signalled). ``gp``: the
    pairs this program filled before (persistent programs: the barriers' phases run on over work items)."""
    BN: gl.constexpr = 64
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])  # 16-byte pieces
    row_l: gl.constexpr = gl.SliceLayout(1, cp_l)
    for p in range(n_pairs):
        ph = ((gp + p) & 1) ^ 1
        z = p // (n_pairs + 1)  # 0: the buffers' addresses formed in the loop (see _math_pp)
        kn0 = k_nope_smem.index(z)
        kn1 = k_nope_smem.index(1 + z)
        kr0 = k_rope_smem.index(z)
        kr1 = k_rope_smem.index(1 + z)
        v0, r0 = _tile_rows(idx_row, start + (2 * p) * BN, stop, S, BN, row_l)
        v1, r1 = _tile_rows(idx_row, start + (2 * p + 1) * BN, stop, S, BN, row_l)
        mbarrier.wait(free.index(0), ph)  # 0L
        _pp_copy_bf16(kn0, kr0, nope_ptr, stride_nope, rope_ptr, stride_rope, v0, r0, 0, cp_l)
        mbarrier.wait(free.index(3), ph)  # 1R
        _pp_copy_bf16(kn1, kr1, nope_ptr, stride_nope, rope_ptr, stride_rope, v1, r1, 1, cp_l)
        cp.wait_group(1)
        _pp_ready(ready.index(0))
        mbarrier.wait(free.index(1), ph)  # 0R
        _pp_copy_bf16(kn0, kr0, nope_ptr, stride_nope, rope_ptr, stride_rope, v0, r0, 1, cp_l)
        cp.wait_group(1)
        _pp_ready(ready.index(3))
        mbarrier.wait(free.index(2), ph)  # 1L
        _pp_copy_bf16(kn1, kr1, nope_ptr, stride_nope, rope_ptr, stride_rope, v1, r1, 0, cp_l)
        cp.wait_group(1)
        _pp_ready(ready.index(1))
        cp.wait_group(0)
        _pp_ready(ready.index(2))
    if CLUSTER > 1:  # the producer's part of the cluster barrier before the in-kernel merge
        _cluster_barrier(PW, False)


@gluon.jit
def _pp_qk(q_nope_smem, q_rope_smem, kn, kr, acc, HALF: gl.constexpr, FIRST: gl.constexpr):
    """Issue (async) one half of ``S = q K^T`` on a tile: HALF 0 the values ``[0, 256)``, HALF 1 ``[256, 512)``
    and the rope part; ``FIRST``: overwrite ``acc``."""
    acc = warpgroup_mma(q_nope_smem.slice(HALF * 256, 256, dim=1), kn.slice(HALF * 256, 256, dim=1).permute((1, 0)),
                        acc, use_acc=not FIRST, is_async=True)
    if HALF == 1:
        acc = warpgroup_mma(q_rope_smem, kr.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def _signal(bar):
    """Every warp of this warpgroup is past this point: one arrive on ``bar``."""
    gl.thread_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _math_pp(q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready, free, xbar,
             q_ptr, stride_qt, stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr,
             t64, hg, sid, T, h_q, S, start, stop, n_pairs, sm_scale_log2, WG: gl.constexpr, HAS_SINK: gl.constexpr,
             SPLIT: gl.constexpr, CLUSTER: gl.constexpr, gp=0, it=0, qfree=None):
    """One math warpgroup of the ping-pong schedule (WG 0: the default partition, WG 1: a worker). Warpgroup
    ``WG`` owns tile ``2p + WG`` of pair ``p`` (buffer ``WG``): its whole ``S [64 heads, 64 rows]`` (m64n64,
    q read once per tile) and softmax, and output columns ``[256 WG, 256 WG + 256)`` of both tiles: P.V with its
    own P from registers, then with the other warpgroup's P from shared memory. One running max for both:
    warpgroup 0 publishes its new max (``xbar`` 0), warpgroup 1 folds it into its own (``xbar`` 1), warpgroup 0
    rescales to that before publishing its P (``xbar`` 2; P of tile 2p lives in buffer 0's rope part, which is no
    longer needed once both QK halves of the tile are done); warpgroup 1 publishes its P (``xbar`` 3). Buffers are
    released per half (``free``) as soon as their last reader is done.

    One work item (token, head group, split). ``qfree`` (persistent programs, :func:`_math_pp_persist`): q is
    copied by the producer, and each warpgroup arrives on ``qfree`` once its last QK of the item is done; ``gp`` /
    ``it``: the pairs and items this program ran before (the barriers' phases)."""
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    DR: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if qfree is None:
        if WG == 0:
            cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            _load_q(q_nope_smem.index(0), q_rope_smem.index(0), q_ptr, stride_qt, stride_qh, t64, hg, h_q, BH, 512, DR,
                    cp_l)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(xbar.index(4))  # q is in
        mbarrier.wait(xbar.index(4), 0)
    p0_smem = k_rope_smem.index(0)  # P of tile 2p: over buffer 0's rope part

    m_run = gl.full([BH], float("-inf"), gl.float32, row_s)
    l_run = gl.zeros([BH], gl.float32, row_s)
    acc = gl.zeros([BH, 256], gl.float32, o_layout)
    sc = gl.zeros([BH, BN], gl.float32, s_layout)  # (its values are never read: each QK overwrites it)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    if qfree is None:  # (a persistent program keeps no registers for the next pair's: it loads its own late)
        idx_t = _tile_idx(idx_row, start + WG * BN, stop, BN, col_l)
    for p in range(n_pairs):
        ph = (gp + p) & 1
        # (z is 0: the buffers' and q's addresses are formed in the loop, so that the compiler does not hoist the
        # wgmma descriptors of every k-step out of it, which spilled them)
        z = p // (n_pairs + 1)
        qn = q_nope_smem.index(z)
        qr = q_rope_smem.index(z)
        kn_own = k_nope_smem.index(WG + z)
        kr_own = k_rope_smem.index(WG + z)
        kn_other = k_nope_smem.index(1 - WG + z)
        if WG == 0:
            if p == 0:  # the first QK (later ones are issued at the end of the previous pair)
                mbarrier.wait(ready.index(0), ph)
                sc = _pp_qk(qn, qr, kn_own, kr_own, sc, 0, True)
                mbarrier.wait(ready.index(1), ph)
                sc = _pp_qk(qn, qr, kn_own, kr_own, sc, 1, False)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        else:
            mbarrier.wait(ready.index(3), ph)
            sc = _pp_qk(qn, qr, kn_own, kr_own, sc, 1, True)
            mbarrier.wait(ready.index(2), ph)
            sc = _pp_qk(qn, qr, kn_own, kr_own, sc, 0, False)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
        if qfree is not None:
            if p == n_pairs - 1:  # this warpgroup's last QK of the item is done: the producer may copy the next q
                _signal(qfree)
        if qfree is not None:
            idx_t = _tile_idx(idx_row, start + (2 * p + WG) * BN, stop, BN, col_l)
        sc = gl.where(_idx_valid(idx_t, S)[None, :], sc * sm_scale_log2, float("-inf"))
        m_prev = m_run
        if WG == 1:
            mbarrier.wait(xbar.index(0), ph)  # warpgroup 0's new max
            m_prev = m_smem.load(row_s)
        m_new = gl.maximum(m_prev, gl.max(sc, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_run - m_use)
        pr = gl.exp2(sc - m_use[:, None])
        l_run = l_run * alpha + gl.sum(pr, 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        m_run = m_new
        m_smem.store(m_new)
        _signal(xbar.index(WG))  # 0: warpgroup 0's max; 1: the pair's max
        p_bf = pr.to(gl.bfloat16)
        # own P from registers, own half of the columns
        acc = warpgroup_mma(gl.convert_layout(p_bf, a_layout), kn_own.slice(256 * WG, 256, dim=1), acc, is_async=True)
        if qfree is None:
            idx_t = _tile_idx(idx_row, start + (2 * p + 2 + WG) * BN, stop, BN, col_l)  # the next pair's (behind P.V)
        if WG == 0:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _signal(free.index(0))  # 0L: QK and this P.V were its readers
            mbarrier.wait(xbar.index(1), ph)  # the pair's max from warpgroup 1
            m_pair = m_smem.load(row_s)
            fix = gl.exp2(m_new - gl.where(m_pair == float("-inf"), 0.0, m_pair))
            # (rescaled from the bf16 P: exact when the pair's max is WG 0's, which is the common case; one more
            # rounding otherwise. Keeping the fp32 P for this would not fit the registers.)
            p0_smem.store((p_bf.to(gl.float32) * gl.convert_layout(fix, row_s)[:, None]).to(gl.bfloat16))
            fence_async_shared()
            _signal(xbar.index(2))
            mbarrier.wait(xbar.index(3), ph)  # P of tile 2p + 1
            acc = acc * gl.convert_layout(fix, row_o)[:, None]
            l_run = l_run * fix
            m_run = m_pair
            if p + 1 < n_pairs:  # P.V with P of tile 2p + 1, then the next pair's QK behind it
                acc = warpgroup_mma(p1_smem, kn_other.slice(0, 256, dim=1), acc, is_async=True)
                mbarrier.wait(ready.index(0), ph ^ 1)
                sc = _pp_qk(qn, qr, kn_own, kr_own, sc, 0, True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                _signal(free.index(2))  # 1L
                mbarrier.wait(ready.index(1), ph ^ 1)
                sc = _pp_qk(qn, qr, kn_own, kr_own, sc, 1, False)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
            else:
                acc = warpgroup_mma(p1_smem, kn_other.slice(0, 256, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _signal(free.index(2))
        else:
            p1_smem.store(p_bf)
            fence_async_shared()
            mbarrier.wait(xbar.index(2), ph)  # P of tile 2p (rescaled to the pair's max)
            acc = warpgroup_mma(p0_smem, kn_other.slice(256, 256, dim=1), acc, is_async=True)
            _signal(xbar.index(3))
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            _signal(free.index(3))  # 1R
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _signal(free.index(1))  # 0R (and P of tile 2p with it)

    # both row sums are relative to the same running max: add them through shared memory (warpgroup 1 stores its
    # sum only after reading warpgroup 0's, so that neither can run an item ahead of the other's read)
    if WG == 0:
        l_smem.slice(0, BH).store(l_run)
        _signal(xbar.index(5))
        mbarrier.wait(xbar.index(6), it & 1)
        l_tot = l_run + l_smem.slice(BH, BH).load(row_s)
    else:
        mbarrier.wait(xbar.index(5), it & 1)
        l_tot = l_run + l_smem.slice(0, BH).load(row_s)
        l_smem.slice(BH, BH).store(l_run)
        _signal(xbar.index(6))
    _epilogue(acc, l_tot, m_run, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr, lse_ptr, t64, hg, sid, T,
              h_q, BH, 256 * WG, 0, o_layout, HAS_SINK, SPLIT, WG == 1)
    if CLUSTER > 1:
        if WG == 1:  # the worker's part of the cluster barrier (after its partial stores)
            _cluster_barrier(4, False)



@gluon.jit
def _pp_item(item, h_q, idx_ptr, stride_it, len_ptr, topk, split_len, HAS_LEN: gl.constexpr):
    """Work item ``item`` of a persistent ping-pong program (one 64-head group of one token, the whole index list):
    ``(t64, hg, idx_row, start, stop, n_pairs)``."""
    t = item // gl.cdiv(h_q, 64)
    t64 = t.to(gl.int64)
    start, stop, n_tiles = _span(len_ptr, t, 0, topk, split_len, 64, HAS_LEN)
    return t64, item % gl.cdiv(h_q, 64), idx_ptr + t64 * stride_it, start, stop, (n_tiles + 1) // 2


@gluon.jit
def _pp_copy_q(q_nope_smem, q_rope_smem, q_ptr, stride_qt, stride_qh, t64, hg, h_q, cp_l: gl.constexpr):
    """cp.async the 64-head group's q rows into shared memory (heads past h_q zero-filled), as one group. The
    launcher checks that the rows start on 16-byte boundaries (strides multiples of 8 elements)."""
    offs_h = hg * 64 + gl.arange(0, 64, gl.SliceLayout(1, cp_l))
    row = q_ptr + gl.multiple_of(t64 * stride_qt + offs_h.to(gl.int64) * stride_qh, 8)[:, None]
    m = (offs_h < h_q)[:, None]
    cols = gl.arange(0, 256, gl.SliceLayout(0, cp_l))
    cp.async_copy_global_to_shared(q_nope_smem.slice(0, 256, dim=1), row + cols[None, :], mask=m)
    cp.async_copy_global_to_shared(q_nope_smem.slice(256, 256, dim=1), row + 256 + cols[None, :], mask=m)
    cp.async_copy_global_to_shared(q_rope_smem, row + 512 + gl.arange(0, 64, gl.SliceLayout(0, cp_l))[None, :],
                                   mask=m)
    cp.commit_group()


@gluon.jit
def _producer_pp_persist(q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, ready, free, qfree, q_ptr, stride_qt,
                         stride_qh, nope_ptr, stride_nope, rope_ptr, stride_rope, idx_ptr, stride_it, len_ptr, T, h_q, S,
                         topk, split_len, HAS_LEN: gl.constexpr, PW: gl.constexpr):
    """Producer of a persistent ping-pong program: for each of its work items (``item = pid + k * programs``) the
    item's q, copied once both math warpgroups have done their last QK of the previous item (``qfree``) and
    issued before the item's first half tile (whose ``ready`` thus also covers q), then :func:`_producer_pp`."""
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [PW, 1], [1, 0])
    gp = 0
    qi = 0
    for item in range(gl.program_id(0), T * gl.cdiv(h_q, 64), gl.num_programs(0)):
        t64, hg, idx_row, start, stop, n_pairs = _pp_item(item, h_q, idx_ptr, stride_it, len_ptr, topk, split_len,
                                                          HAS_LEN)
        if n_pairs > 0:  # (an empty item reads no q)
            mbarrier.wait(qfree.index(0), (qi & 1) ^ 1)
            _pp_copy_q(q_nope_smem.index(0), q_rope_smem.index(0), q_ptr, stride_qt, stride_qh, t64, hg, h_q, cp_l)
            qi += 1
        _producer_pp(k_nope_smem, k_rope_smem, ready, free, nope_ptr, stride_nope, rope_ptr, stride_rope, idx_row,
                     start, n_pairs, stop, S, gp, PW, 0)
        gp += n_pairs


@gluon.jit
def _math_pp_persist(q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready, free, xbar,
                     qfree, q_ptr, stride_qt, stride_qh, idx_ptr, stride_it, len_ptr, sink_ptr, out_ptr, stride_ot,
                     stride_oh, ml_ptr, lse_ptr, T, h_q, S, topk, split_len, sm_scale_log2, WG: gl.constexpr,
                     HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr):
    """Math warpgroup ``WG`` of a persistent ping-pong program: :func:`_math_pp` on each of its work items."""
    gp = 0
    it = 0
    for item in range(gl.program_id(0), T * gl.cdiv(h_q, 64), gl.num_programs(0)):
        t64, hg, idx_row, start, stop, n_pairs = _pp_item(item, h_q, idx_ptr, stride_it, len_ptr, topk, split_len,
                                                          HAS_LEN)
        _math_pp(q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready, free, xbar, q_ptr,
                 stride_qt, stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, 0, ml_ptr, lse_ptr, t64, hg, 0,
                 T, h_q, S, start, stop, n_pairs, sm_scale_log2, WG, HAS_SINK, False, 0, gp, it, qfree)
        gp += n_pairs
        it += 1


def _compile_with_cluster(src, *args, **kwargs):
    """The kernel's compile step: a variant with ``CLUSTER`` > 1 launches its grid axis 0 as clusters of that many
    CTAs. (Triton's own ``num_ctas`` would also distribute every tensor layout over the cluster; here each CTA
    is a whole program, so only the launch changes: the launcher reads the cluster size from the packed metadata,
    runs ``grid[0] * CLUSTER`` CTAs and sets the non-portable-size attribute for 16.) On a GPU, each variant is
    also loaded and asked for the most L1 its shared memory leaves (:func:`_prefer_l1`)."""
    kernel = triton.compile(src, *args, **kwargs)
    n = src.constants.get((src.fn.arg_names.index("CLUSTER"), ), 0)
    if n > 1:
        nw, _, shared = kernel.packed_metadata
        kernel.packed_metadata = (nw, int(n), shared)
    from ..backend import on_hopper

    if torch.cuda.is_available() and on_hopper(torch.device("cuda")):  # (not in the CPU compile tests)
        _prefer_l1(kernel)
    return kernel


#: ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` (cuda.h)
_CARVEOUT_ATTR = 9


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _prefer_l1(kernel) -> None:
    """Ask the driver for the smallest shared-memory carveout that holds the kernel (preference 0 %): the rest of
    each SM's 256 KiB is L1. Left to itself the driver timed the same as with the largest carveout (228 KiB,
    28 KiB of L1); the fp8 producer's row loads go through L1, and with the rest (60 KiB) small-head fp8
    decode measured 5-9% faster on the H200 (BENCHMARKS.md; the indexer's kernels, several CTAs per SM, were
    1.6-2.1x slower with it). A hint: a driver that refuses it changes nothing but the speed, so it only
    warns."""
    kernel._init_handles()
    try:
        rc = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(kernel.function), _CARVEOUT_ATTR, 0)
    except (OSError, AttributeError) as e:  # no loadable libcuda.so.1 (Triton found the driver another way)
        rc = f"{type(e).__name__}: {e}"
    if rc != 0:
        warnings.warn(f"sparse_mla: cuFuncSetAttribute(preferred shared-memory carveout) returned {rc}; "
                      "the Hopper kernel keeps the driver's default split", RuntimeWarning, stacklevel=2)


class _ClusterJITFunction(GluonJITFunction):
    """A Gluon kernel whose variants compile through :func:`_compile_with_cluster` (Triton sets ``compile`` when it
    first binds the kernel to a device, so it is replaced there)."""

    def create_binder(self):
        binder = super().create_binder()
        self.compile = _compile_with_cluster
        return binder


@functools.partial(_ClusterJITFunction, do_not_specialize=["T", "h_q", "S", "topk", "split_len"])
def _sparse_mla_sm90_kernel(
    q_ptr, stride_qt, stride_qh,
    nope_ptr, stride_nope,
    scale_ptr, stride_scale,
    rope_ptr, stride_rope,
    idx_ptr, stride_it,
    len_ptr, sink_ptr,
    out_ptr, stride_ot, stride_oh, stride_os,
    ml_ptr, lse_ptr,
    fout_ptr, stride_fot, stride_foh, fml_ptr, flse_ptr,  # CLUSTER: the merged results (else unused)
    skip_ptr,  # SKIP >= 0: an int32 flag; where it equals SKIP the kernel returns at once (else unused)
    T, h_q, S, topk, split_len,
    sm_scale_log2,
    IS_FP8: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
    BH: gl.constexpr, PINGPONG: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    EARLY: gl.constexpr, MATH_REGS: gl.constexpr, CLUSTER: gl.constexpr, ALT: gl.constexpr,
    LAZY: gl.constexpr = False, PERSIST: gl.constexpr = False, SKIP: gl.constexpr = -1,
):
    """Warp-specialised sparse MLA for a group of ``BH`` heads, same arguments and results as the Triton kernel:
    a producer warpgroup copies, and for fp8_ds_mla dequantises, the gathered rows into two bf16 tile buffers
    while the math warps run the products and the softmax of the other one.

    * ``PINGPONG`` (64 heads, bf16 cache; launched with 4 warps): two math warpgroups owning alternate tiles
      (:func:`_math_pp`; the worker one with ``MATH_REGS`` registers), :func:`_producer_pp`, each buffer released
      in halves.
    * else 64 heads (8 warps): two math warpgroups sharing each tile (:func:`_math_64`); 16 or 32 heads
      (4 warps): one, the rows as M (:func:`_math_rows`); :func:`_producer` (``EARLY`` fp8 groups loaded before a
      buffer is free), two mbarriers per buffer (full, empty)."""
    if SKIP >= 0:  # (a launch whose work another launch does, as a flag on the device says: see launch())
        if gl.load(skip_ptr) == SKIP:
            return
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    t, t64, hg, sid = _token_group(h_q, BH, CLUSTER)
    idx_row = idx_ptr + t64 * stride_it
    if PINGPONG:
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_nope_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BH, DV], sh)
        q_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BH, DR], sh)
        k_nope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DV], sh)
        k_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DR], sh)
        p1_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], sh)
        m_smem = gl.allocate_shared_memory(gl.float32, [BH], vec)
        l_smem = gl.allocate_shared_memory(gl.float32, [2 * BH], vec)
        ready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        xbar = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(4):
            mbarrier.init(ready.index(j), count=1)
            mbarrier.init(free.index(j), count=1)
        for j in gl.static_range(7):
            mbarrier.init(xbar.index(j), count=1)
        start, stop, n_tiles = _span(len_ptr, t, sid, topk, split_len, BN, HAS_LEN)  # (after the barriers' init:
        n_pairs = (n_tiles + 1) // 2  # the order the kernel was measured in)
        if PERSIST:
            qfree = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
            mbarrier.init(qfree.index(0), count=2)
            gl.warp_specialize([
                (_math_pp_persist, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready,
                                    free, xbar, qfree.index(0), q_ptr, stride_qt, stride_qh, idx_ptr, stride_it,
                                    len_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, ml_ptr, lse_ptr, T, h_q, S, topk,
                                    split_len, sm_scale_log2, 0, HAS_LEN, HAS_SINK)),
                (_math_pp_persist, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready,
                                    free, xbar, qfree.index(0), q_ptr, stride_qt, stride_qh, idx_ptr, stride_it,
                                    len_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, ml_ptr, lse_ptr, T, h_q, S, topk,
                                    split_len, sm_scale_log2, 1, HAS_LEN, HAS_SINK)),
                (_producer_pp_persist, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, ready, free, qfree, q_ptr,
                                        stride_qt, stride_qh, nope_ptr, stride_nope, rope_ptr, stride_rope, idx_ptr,
                                        stride_it, len_ptr, T, h_q, S, topk, split_len, HAS_LEN, PRODUCER_WARPS)),
            ], [4, PRODUCER_WARPS], [MATH_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_math_pp, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready, free, xbar,
                            q_ptr, stride_qt, stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os,
                            ml_ptr, lse_ptr, t64, hg, sid, T, h_q, S, start, stop, n_pairs, sm_scale_log2, 0, HAS_SINK,
                            SPLIT, CLUSTER)),
                (_math_pp, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p1_smem, m_smem, l_smem, ready, free, xbar,
                            q_ptr, stride_qt, stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os,
                            ml_ptr, lse_ptr, t64, hg, sid, T, h_q, S, start, stop, n_pairs, sm_scale_log2, 1, HAS_SINK,
                            SPLIT, CLUSTER)),
                (_producer_pp, (k_nope_smem, k_rope_smem, ready, free, nope_ptr, stride_nope, rope_ptr, stride_rope,
                                idx_row, start, n_pairs, stop, S, 0, PRODUCER_WARPS, CLUSTER)),
            ], [4, PRODUCER_WARPS], [MATH_REGS, PRODUCER_REGS])
    else:
        q_nope_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DV], sh)
        q_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DR], sh)
        k_nope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DV], sh)
        k_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DR], sh)
        if BH == 64:
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], sh)
        else:  # P^T
            p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH],
                                               gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16))
            # (the lazy softmax's maxima when P is redone, :func:`_math_rows`)
            m_smem = gl.allocate_shared_memory(gl.float32, [4, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            mbarrier.init(full.index(j), count=1)
            mbarrier.init(empty.index(j), count=1)
        start, stop, n_tiles = _span(len_ptr, t, sid, topk, split_len, BN, HAS_LEN)
        if BH == 64:
            gl.warp_specialize([
                (_math_64, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p_smem, full, empty, q_ptr, stride_qt,
                            stride_qh, idx_row, len_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr,
                            lse_ptr, t, t64, hg, sid, T, h_q, S, start, stop, n_tiles, sm_scale_log2, HAS_SINK, SPLIT)),
                (_producer, (k_nope_smem, k_rope_smem, full, empty, nope_ptr, stride_nope, scale_ptr, stride_scale,
                             rope_ptr, stride_rope, idx_row, start, n_tiles, stop, S, IS_FP8, PRODUCER_WARPS, EARLY,
                             CLUSTER)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
        elif ALT:  # 16/32 heads: two producer warpgroups, each filling every other tile (:func:`alternate_tiles`)
            gl.warp_specialize([
                (_math_rows, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p_smem, full, empty, q_ptr,
                              stride_qt, stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr,
                              lse_ptr, t64, hg, sid, T, h_q, S, start, stop, n_tiles, sm_scale_log2, BH, HAS_SINK,
                              SPLIT, m_smem, LAZY)),
                (_producer, (k_nope_smem, k_rope_smem, full, empty, nope_ptr, stride_nope, scale_ptr, stride_scale,
                             rope_ptr, stride_rope, idx_row, start, n_tiles, stop, S, IS_FP8, 4, EARLY, CLUSTER, 0, 2)),
                (_producer, (k_nope_smem, k_rope_smem, full, empty, nope_ptr, stride_nope, scale_ptr, stride_scale,
                             rope_ptr, stride_rope, idx_row, start, n_tiles, stop, S, IS_FP8, 4, EARLY, CLUSTER, 1, 2)),
            ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_math_rows, (q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, p_smem, full, empty, q_ptr,
                              stride_qt, stride_qh, idx_row, sink_ptr, out_ptr, stride_ot, stride_oh, stride_os, ml_ptr,
                              lse_ptr, t64, hg, sid, T, h_q, S, start, stop, n_tiles, sm_scale_log2, BH, HAS_SINK,
                              SPLIT, m_smem, LAZY)),
                (_producer, (k_nope_smem, k_rope_smem, full, empty, nope_ptr, stride_nope, scale_ptr, stride_scale,
                             rope_ptr, stride_rope, idx_row, start, n_tiles, stop, S, IS_FP8, PRODUCER_WARPS, EARLY,
                             CLUSTER)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
    if CLUSTER > 1:  # every CTA of the cluster has stored its partials: merge them
        NW: gl.constexpr = 4 if PINGPONG or BH < 64 else 8
        _cluster_barrier(NW, True)
        t, t64, hg, sid = _token_group(h_q, BH, CLUSTER)  # (not kept live through the partitions)
        _cluster_merge(out_ptr, lse_ptr, ml_ptr, sink_ptr, fout_ptr, stride_fot, stride_foh, fml_ptr, flse_ptr, t64,
                       hg, sid, T, h_q, BH, CLUSTER, HAS_SINK, NW)


def supported(q: torch.Tensor, kv: torch.Tensor, block_h: int) -> bool:
    """Whether :func:`_sparse_mla_sm90_kernel` serves the call: head groups of 64, 32 or 16 on an NVIDIA
    Hopper GPU (:func:`dsa.backend.on_hopper`: not ROCm, not under the Triton interpreter), either cache
    format (``kv`` the flat ``[S, 576]`` bf16 or ``[S, 656]`` uint8 view) starting on a 16-byte boundary
    (its rows are copied in 16-byte pieces; a cache that does not is served by the Triton kernel)."""
    from ..backend import on_hopper

    return block_h in (16, 32, BLOCK_H) and kv.data_ptr() % 16 == 0 and on_hopper(q.device)


#: largest cluster (split count merged inside the kernel): 16 CTAs is the largest (non-portable) size on Hopper
MAX_CLUSTER = 16

#: ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES``, ``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED`` and
#: ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`` (cuda.h)
_DYN_SMEM_ATTR, _NON_PORTABLE_ATTR, _CLUSTER_DIM_LAUNCH_ATTR = 8, 14, 4
#: the probe's shared memory: over half an SM's, so one CTA per SM, as every small-head variant (160-225 KiB)
_PROBE_SMEM = 160 * 1024


@triton.jit
def _cluster_probe(x_ptr):
    """Compiled, never launched: the function :func:`max_active_clusters` asks the driver about."""
    pass


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _LaunchAttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("cluster_dim", _Dim3)]


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _LaunchAttrValue)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def max_active_clusters(n: int, device_index: int = 0) -> int | None:
    """How many clusters of ``n`` CTAs, one CTA per SM, GPU ``device_index`` runs at once
    (``cuOccupancyMaxActiveClusters`` on a probe kernel); None when the driver cannot say. A cluster's CTAs must
    sit in one GPC, so this is below ``num_sms // n`` where a GPC's SM count is not a multiple of ``n``. H200
    (132 SMs; BENCHMARKS.md, twenty-third session): 66 / 30 / 15 / 7 clusters of 2 / 4 / 8 / 16."""
    try:
        with torch.cuda.device(device_index):
            probe = _cluster_probe.warmup(torch.float32, grid=(1, ))
            probe._init_handles()
            lib = _libcuda()
            fn = ctypes.c_void_p(probe.function)
            if (lib.cuFuncSetAttribute(fn, _DYN_SMEM_ATTR, _PROBE_SMEM) != 0
                    or lib.cuFuncSetAttribute(fn, _NON_PORTABLE_ATTR, 1) != 0):
                return None
            attr = _LaunchAttr(id=_CLUSTER_DIM_LAUNCH_ATTR)
            attr.value.cluster_dim = _Dim3(n, 1, 1)
            cfg = _LaunchConfig((n, 1, 1), (128, 1, 1), _PROBE_SMEM, None, ctypes.pointer(attr), 1)
            count = ctypes.c_int(0)
            rc = lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), fn, ctypes.byref(cfg))
    except Exception:  # (no driver library, or a Triton whose compiled kernels differ: the caller's fallback)
        return None
    return int(count.value) if rc == 0 else None


def producer_config(is_fp8: bool, block_h: int, pingpong: bool, producer: dict | None = None,
                    waves: bool = False) -> dict:
    """The producer settings a launch uses: ``warps``, ``regs``, ``early`` (fp8 groups loaded before a buffer is
    free), ``math_regs`` (the ping-pong's worker math warpgroup) and ``alt`` (tiles per program from which two
    producer warpgroups take alternate tiles, :func:`alternate_tiles`): :data:`PRODUCER_PP` for the ping-pong
    schedule, :data:`PRODUCER_ROWS_FP8` for 16/32-head groups over the fp8 cache, :data:`PRODUCER_ROWS_BF16_WAVES`
    over :data:`PRODUCER` for 16-head groups over the bf16 cache in a launch of more CTAs than SMs (``waves``), else
    :data:`PRODUCER`; then ``producer``'s entries over them (benchmarks)."""
    if pingpong:
        base = PRODUCER_PP
    elif is_fp8 and block_h < BLOCK_H:
        base = PRODUCER_ROWS_FP8
    elif waves and not is_fp8 and block_h == 16:
        base = {**PRODUCER[False], **PRODUCER_ROWS_BF16_WAVES}
    else:
        base = PRODUCER[is_fp8]
    return {"warps": PRODUCER_WARPS, "early": 0, "math_regs": 0, "alt": 0, **base, **(producer or {})}


def alternate_tiles(prod: dict, block_h: int, split_len: int) -> bool:
    """Whether the two producer warpgroups of a 16/32-head group take alternate tiles (``prod`` from
    :func:`producer_config`): with two warpgroups (``warps`` 8), ``alt`` > 0 and at least ``alt`` tiles per
    program (``split_len`` rows)."""
    return block_h < BLOCK_H and prod["warps"] == 8 and prod["alt"] > 0 and split_len >= prod["alt"] * BLOCK_N


def launch(grid, q, nope, scales, stride_scale, rope, indices, len_arg, sink_arg, out, stride_ot, stride_oh,
           stride_os, ml, lse, T, h_q, S, topk, split_len, scale_log2, has_len, has_sink, split, block_h=BLOCK_H,
           producer=None, pingpong=None, cluster=0, final=None, num_sms=0, persist=None, skip=None):
    """Launch on validated, prepared arguments (called by :func:`dsa.mla.kernel.sparse_mla_triton` when
    :func:`supported`); ``producer`` overrides entries of what :func:`producer_config` picks (``waves``: more CTAs
    than ``num_sms``) (``regs``, ``early``, ``warps``, ``math_regs``, ``alt``: benchmarks, tests); ``pingpong``
    (64-head groups) picks the ping-pong schedule (``None``: :data:`PINGPONG`). ``cluster`` > 1 (a power of two, at most
    :data:`MAX_CLUSTER`; ``grid`` = ``(T * head groups, 1)``): the ``cluster`` splits of each (token, head group)
    run as one cluster of CTAs, which merge their partials (``out``, ``ml``, ``lse``: ``[cluster, T, h_q, ...]``
    fp32) inside the kernel into ``final = (out, stride_ot, stride_oh, max_logits, lse)``. ``persist`` (``None``:
    :data:`PERSIST` with h_q > 64): an unsplit ping-pong launch runs ``min(grid[0], num_sms)`` persistent programs
    instead. ``skip = (flag, value)`` (``flag`` ``[1]`` int32 on the device): where ``flag`` holds ``value`` every
    CTA returns at once, writing nothing (one of two launches of which a flag computed on the device picks one)."""
    # what the copies assume: every row's values and rope part start on a 16-byte boundary
    assert nope.stride(0) * nope.element_size() % 16 == 0 and rope.stride(0) * rope.element_size() % 16 == 0
    assert nope.data_ptr() % 16 == 0 and rope.data_ptr() % 16 == 0
    is_fp8 = nope.dtype != torch.bfloat16
    if pingpong and (is_fp8 or block_h != BLOCK_H):
        raise ValueError("config pingpong=True: the ping-pong schedule serves 64-head groups over the bf16 cache only")
    cluster = int(cluster or 0)
    if cluster > 1:
        assert split and grid[1] == 1 and final is not None
        assert cluster <= MAX_CLUSTER and cluster & (cluster - 1) == 0, cluster
    else:
        cluster, final = 0, (out, 0, 0, ml, lse)  # (unused)
    pp = block_h == BLOCK_H and not is_fp8 and (PINGPONG if pingpong is None else pingpong)
    prod = producer_config(is_fp8, block_h, pp, producer, waves=0 < num_sms < grid[0] * grid[1] * max(cluster, 1))
    if persist is None:
        persist = PERSIST and h_q > BLOCK_H
    persist = (persist and pp and not split and cluster == 0 and num_sms > 0
               and q.data_ptr() % 16 == 0 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0 and q.stride(2) == 1)
    if persist:
        grid = (min(grid[0], num_sms), 1)
    kernel = _sparse_mla_sm90_kernel[grid](
        q, q.stride(0), q.stride(1), nope, nope.stride(0), scales, stride_scale, rope, rope.stride(0), indices,
        indices.stride(0), len_arg, sink_arg, out, stride_ot, stride_oh, stride_os, ml, lse, *final,
        lse if skip is None else skip[0], T, h_q, S, topk, split_len, scale_log2, IS_FP8=is_fp8, HAS_LEN=has_len,
        HAS_SINK=has_sink, SPLIT=split, BH=block_h,
        PINGPONG=pp, PRODUCER_WARPS=prod["warps"], PRODUCER_REGS=prod["regs"], EARLY=prod["early"],
        MATH_REGS=prod["math_regs"], CLUSTER=cluster, ALT=alternate_tiles(prod, block_h, split_len),
        LAZY=block_h in LAZY_MAX, PERSIST=persist, SKIP=-1 if skip is None else int(skip[1]),
        num_warps=8 if block_h == BLOCK_H and not pp else 4)
    if cluster > 1 and kernel.packed_metadata[1] != cluster:  # (a Triton whose launch path differs)
        raise RuntimeError(f"sparse_mla: the Hopper kernel was not launched as clusters of {cluster} CTAs")
