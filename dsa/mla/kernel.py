"""Triton kernels for sparse MLA attention (both MLA cache formats) and their launch code.

Design (see SPEC.md "Sparse MLA attention"; FlashMLA's sparse kernels are the bar):

* One program owns ``BLOCK_H`` heads of one query token (the head group is the M dim of every
  dot: ``BLOCK_H = min(64, next_pow2(max(h_q, 16)))``, heads past ``h_q`` are masked inside the
  kernel, never padded in the caller's tensors) and walks that token's index list in tiles of
  ``BLOCK_N`` gathered cache rows. Each gathered row is loaded once per program and shared by all
  its heads; for fp8_ds_mla it is dequantised once (512 fp8 values times their group scale in
  fp32, rounded to bf16; the 64 rope values are bf16 already).
* The 576-wide QK product is split as four 128-wide groups plus the 64-wide rope part (five
  chained dots) and the 512-wide output is accumulated as four ``[BLOCK_H, 128]`` fp32 column
  blocks, which keeps the fp8 group scale a per-row scalar and the registers in check.
* Online softmax in fp32 with ``exp2`` (``sm_scale * log2(e)`` folded into the logits).
  Invalid entries (index < 0, >= S, or past ``topk_length``) get a ``-inf`` logit and their
  rows are never read (masked loads), so NaN in unused cache slots cannot leak.
* Gathers: all loads of a tile are issued before its first dot (one memory round trip per tile;
  Triton's pipeliner turns the wgmma path's loads into async copies one tile ahead).
* Small head groups over the fp8 cache (``PREFETCH``): their dots run on mma.sync, where Triton's
  pipeliner leaves the fp8 loads synchronous (they reach the dots only through the dequantisation),
  so the raw bytes and scales of the next tile are loaded by hand while the current one is used.
* Work split: when ``T * ceil(h_q / BLOCK_H)`` programs cannot fill the GPU (decode), the index
  list is cut into ``num_splits`` chunks handled by separate programs which write partial
  (normalised out, lse, max) in fp32; a small second kernel merges them by lse (programs of 2-4 heads,
  :func:`combine_config`, so that many SMs read the partials at once; on Hopper, small
  head groups merge inside the split kernel instead wherever the GPU runs all their clusters at once, see
  :func:`cluster_size`). The
  caller's arguments are the same either way.
* Locality: calls of many tokens over a large cache first group each token's index list by slot range
  (:mod:`dsa.mla.order`, one small launch; :func:`order_pays` decides), so the programs that run side by side
  gather from the same part of the cache and find each other's rows in L2.

Known limit (from the compiled code, sm_90): for the chained QK -> PV dots Triton lays the
``[BLOCK_H=64, BLOCK_N]`` logits over 8 warps as ``warpsPerCTA=[8, 1]``, so both warpgroups compute
the whole QK product (m64n32k16 wgmma, shared-memory bound) while P·V is split between them:
about 1.5x the useful MMA work, and no warp can copy while others compute. On Hopper (sm_90) every
head group therefore goes to the Gluon kernel of :mod:`dsa.mla.kernel_sm90`, which places the work on
the warpgroups by hand and gives the copies (and fp8 dequantisation) to a producer warpgroup (same
arguments, same results; ``config=dict(gluon=False)`` keeps this kernel); 16/32-head groups there make
the gathered rows the M dimension, and 64-head groups over the bf16 cache alternate tiles between the two
math warpgroups (FlashMLA's ping-pong). Decode with 1-16 heads over the fp8_ds_mla cache at the batches where
it is faster goes to :mod:`dsa.mla.kernel_bulk` instead (rows by bulk copies, operands converted in registers for
``mma.sync``; ``config=dict(bulk=False)`` keeps :mod:`dsa.mla.kernel_sm90`). Measured numbers are in BENCHMARKS.md
(benchmarks/bench_mla.py, bench_mla_bulk.py, sweep.py).
Applying the fp8 group scale to the dot results instead of to every value (exact, fewer multiplies)
was measured 1.5x slower at h_q 128 and 64 (Triton's separate per-group dots and four scaled copies
of P cost more than the per-value multiply), so each value is dequantised once, as here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, launch_fitting, next_power_of_2
from .. import backend
from ..constants import D_QK, D_V, FP8_DS_MLA_GROUP, H200_NUM_SMS, KV_LORA_RANK, ROPE_DIM
from ..layouts import fp8_ds_mla_views
from ..fp8 import tl_fp8_to_f32
from .compact import compact
from .epilogue import merge_weights, outputs, row_stats
from .order import DEFAULT_BUCKETS, MAX_ORDER_TOPK, order_indices

try:  # the Hopper kernels are written in Gluon (Triton >= 3.5); without it every call takes the Triton kernel
    from . import kernel_bulk, kernel_sm90
except ImportError:  # pragma: no cover
    kernel_bulk = kernel_sm90 = None

_LOG2E = 1.4426950408889634


@triton.jit
def _load_group(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, g: tl.constexpr,
                GROUP: tl.constexpr, IS_FP8: tl.constexpr, FP8_MODE: tl.constexpr):
    """Cache values ``[g*GROUP, (g+1)*GROUP)`` of the gathered rows as bf16 ``[BLOCK_N, GROUP]``."""
    offs = g * GROUP + tl.arange(0, GROUP)
    k = tl.load(nope_ptr + rows[:, None] * stride_nope + offs[None, :], mask=valid[:, None], other=0.0)
    if IS_FP8:
        k = _dequant(k, tl.load(scale_ptr + rows * stride_scale + g, mask=valid, other=0.0), FP8_MODE)
    return k


@triton.jit
def _dequant(raw, sc, FP8_MODE: tl.constexpr):
    """fp8 values ``[BLOCK_N, GROUP]`` (e4m3fn, or their bytes: ``FP8_MODE``, :func:`dsa.backend.fp8_mode`) times
    their per-row group scale ``[BLOCK_N]`` (fp32), as bf16."""
    return (tl_fp8_to_f32(raw, FP8_MODE) * sc[:, None]).to(tl.bfloat16)


@triton.jit
def _tile_rows(idx_row, n0, stop, S, BLOCK_N: tl.constexpr):
    """Index-list entries ``[n0, n0 + BLOCK_N)`` (those ``>= stop`` invalid): (valid, int64 rows)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    in_range = offs_n < stop
    idx = tl.load(idx_row + offs_n, mask=in_range, other=-1)
    valid = in_range & (idx >= 0) & (idx < S)
    return valid, tl.where(valid, idx, 0).to(tl.int64)


@triton.jit
def _load_raw(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, GROUP: tl.constexpr):
    """Raw fp8 values (four ``[BLOCK_N, GROUP]`` groups) and their four group scales, not yet dequantised."""
    offs = tl.arange(0, GROUP)
    base = nope_ptr + rows[:, None] * stride_nope + offs[None, :]
    r0 = tl.load(base + 0 * GROUP, mask=valid[:, None], other=0.0)
    r1 = tl.load(base + 1 * GROUP, mask=valid[:, None], other=0.0)
    r2 = tl.load(base + 2 * GROUP, mask=valid[:, None], other=0.0)
    r3 = tl.load(base + 3 * GROUP, mask=valid[:, None], other=0.0)
    sb = scale_ptr + rows * stride_scale
    s0 = tl.load(sb + 0, mask=valid, other=0.0)
    s1 = tl.load(sb + 1, mask=valid, other=0.0)
    s2 = tl.load(sb + 2, mask=valid, other=0.0)
    s3 = tl.load(sb + 3, mask=valid, other=0.0)
    return r0, r1, r2, r3, s0, s1, s2, s3


@triton.jit
def _attend(q0, q1, q2, q3, qr, kr, k0, k1, k2, k3, valid, sm_scale_log2, m_i, l_i, acc0, acc1, acc2, acc3):
    """One tile of gathered rows (bf16): QK^T as five chained dots (64 rope + 4 x 128 nope), the online
    softmax update (exp2, fp32) and P.V into the four 128-column accumulators."""
    s = tl.dot(qr, tl.trans(kr))
    s = tl.dot(q0, tl.trans(k0), s)
    s = tl.dot(q1, tl.trans(k1), s)
    s = tl.dot(q2, tl.trans(k2), s)
    s = tl.dot(q3, tl.trans(k3), s)
    s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: avoid -inf - -inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pb = p.to(tl.bfloat16)
    acc0 = tl.dot(pb, k0, acc0 * alpha[:, None])
    acc1 = tl.dot(pb, k1, acc1 * alpha[:, None])
    acc2 = tl.dot(pb, k2, acc2 * alpha[:, None])
    acc3 = tl.dot(pb, k3, acc3 * alpha[:, None])
    return m_new, l_i, acc0, acc1, acc2, acc3


# sizes that vary call to call are not specialised (one compiled kernel per config, not per shape)
@triton.jit(do_not_specialize=["T", "h_q", "S", "topk", "split_len"])
def _sparse_mla_fwd_kernel(
    q_ptr, stride_qt, stride_qh,
    nope_ptr, stride_nope,  # [S, 512] bf16 (bf16 cache) or float8_e4m3fn (fp8_ds_mla values)
    scale_ptr, stride_scale,  # [S, 4] f32 group scales (fp8_ds_mla only)
    rope_ptr, stride_rope,  # [S, 64] bf16
    idx_ptr, stride_it,  # [T, topk] int32
    len_ptr,  # [T] int32 topk_length (HAS_LEN)
    sink_ptr,  # [h_q] f32 (HAS_SINK)
    out_ptr, stride_ot, stride_oh,  # bf16 [T, h_q, 512] or, with SPLIT, f32 partials [NS, T, h_q, 512] (stride_os)
    stride_os,
    ml_ptr, lse_ptr,  # f32 [T, h_q] or, with SPLIT, [NS, T, h_q]
    skip_ptr,  # SKIP >= 0: an int32 flag; where it equals SKIP the program returns at once (else unused)
    T, h_q, S, topk, split_len,
    sm_scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr,
    GROUP: tl.constexpr, D_ROPE: tl.constexpr, PREFETCH: tl.constexpr, FP8_MODE: tl.constexpr,
    SKIP: tl.constexpr = -1,
):
    if SKIP >= 0:  # (a launch whose work another launch does, as a flag on the device says)
        if tl.load(skip_ptr) == SKIP:
            return
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    n_hg = tl.cdiv(h_q, BLOCK_H)
    t = pid // n_hg
    hg = pid % n_hg
    t64 = t.to(tl.int64)

    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < h_q
    offs_g = tl.arange(0, GROUP)
    offs_r = tl.arange(0, D_ROPE)
    q_row = q_ptr + t64 * stride_qt + offs_h[:, None] * stride_qh
    q0 = tl.load(q_row + 0 * GROUP + offs_g[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + 1 * GROUP + offs_g[None, :], mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + 2 * GROUP + offs_g[None, :], mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + 3 * GROUP + offs_g[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(q_row + 4 * GROUP + offs_r[None, :], mask=hmask[:, None], other=0.0)

    end = topk
    if HAS_LEN:
        end = tl.minimum(end, tl.load(len_ptr + t))
    start = sid * split_len
    stop = tl.minimum(start + split_len, end)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, GROUP], tl.float32)
    idx_row = idx_ptr + t64 * stride_it
    if PREFETCH:
        # fp8 cache with mma.sync-sized tiles (small head groups): Triton's pipeliner leaves the fp8
        # loads synchronous there (they feed the dots only after the dequantisation), so the raw
        # bytes and scales of tile i+1 are loaded here while tile i is dequantised and multiplied.
        valid, rows = _tile_rows(idx_row, start, stop, S, BLOCK_N)
        r0, r1, r2, r3, s0, s1, s2, s3 = _load_raw(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, GROUP)
        for n0 in range(start, stop, BLOCK_N):
            valid_n, rows_n = _tile_rows(idx_row, n0 + BLOCK_N, stop, S, BLOCK_N)
            r0n, r1n, r2n, r3n, s0n, s1n, s2n, s3n = _load_raw(nope_ptr, scale_ptr, rows_n, stride_nope, stride_scale,
                                                               valid_n, GROUP)
            kr = tl.load(rope_ptr + rows[:, None] * stride_rope + offs_r[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend(q0, q1, q2, q3, qr, kr, _dequant(r0, s0, FP8_MODE),
                                                       _dequant(r1, s1, FP8_MODE), _dequant(r2, s2, FP8_MODE),
                                                       _dequant(r3, s3, FP8_MODE), valid, sm_scale_log2,
                                                       m_i, l_i, acc0, acc1, acc2, acc3)
            valid = valid_n
            rows = rows_n
            r0, r1, r2, r3, s0, s1, s2, s3 = r0n, r1n, r2n, r3n, s0n, s1n, s2n, s3n
    else:
        for n0 in range(start, stop, BLOCK_N):
            valid, rows = _tile_rows(idx_row, n0, stop, S, BLOCK_N)
            # gathered rows as bf16 (fp8 dequantised), all loads issued before the first dot
            kr = tl.load(rope_ptr + rows[:, None] * stride_rope + offs_r[None, :], mask=valid[:, None], other=0.0)
            k0 = _load_group(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, 0, GROUP, IS_FP8, FP8_MODE)
            k1 = _load_group(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, 1, GROUP, IS_FP8, FP8_MODE)
            k2 = _load_group(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, 2, GROUP, IS_FP8, FP8_MODE)
            k3 = _load_group(nope_ptr, scale_ptr, rows, stride_nope, stride_scale, valid, 3, GROUP, IS_FP8, FP8_MODE)
            m_i, l_i, acc0, acc1, acc2, acc3 = _attend(q0, q1, q2, q3, qr, kr, k0, k1, k2, k3, valid, sm_scale_log2,
                                                       m_i, l_i, acc0, acc1, acc2, acc3)

    inv, lse, ml = row_stats(l_i, m_i, sink_ptr, offs_h, hmask, HAS_SINK, SPLIT)
    if SPLIT:  # partial: normalised out, lse and max in log2 units
        o_base = out_ptr + sid.to(tl.int64) * stride_os + t64 * stride_ot + offs_h[:, None] * stride_oh
        ml_off = (sid.to(tl.int64) * T + t64) * h_q + offs_h
        tl.store(o_base + 0 * GROUP + offs_g[None, :], acc0 * inv[:, None], mask=hmask[:, None])
        tl.store(o_base + 1 * GROUP + offs_g[None, :], acc1 * inv[:, None], mask=hmask[:, None])
        tl.store(o_base + 2 * GROUP + offs_g[None, :], acc2 * inv[:, None], mask=hmask[:, None])
        tl.store(o_base + 3 * GROUP + offs_g[None, :], acc3 * inv[:, None], mask=hmask[:, None])
    else:
        o_base = out_ptr + t64 * stride_ot + offs_h[:, None] * stride_oh
        ml_off = t64 * h_q + offs_h
        tl.store(o_base + 0 * GROUP + offs_g[None, :], (acc0 * inv[:, None]).to(tl.bfloat16), mask=hmask[:, None])
        tl.store(o_base + 1 * GROUP + offs_g[None, :], (acc1 * inv[:, None]).to(tl.bfloat16), mask=hmask[:, None])
        tl.store(o_base + 2 * GROUP + offs_g[None, :], (acc2 * inv[:, None]).to(tl.bfloat16), mask=hmask[:, None])
        tl.store(o_base + 3 * GROUP + offs_g[None, :], (acc3 * inv[:, None]).to(tl.bfloat16), mask=hmask[:, None])
    tl.store(lse_ptr + ml_off, lse, mask=hmask)
    tl.store(ml_ptr + ml_off, ml, mask=hmask)


@triton.jit(do_not_specialize=["T", "h_q", "num_splits"])
def _sparse_mla_combine_kernel(
    o_part_ptr, lse_part_ptr, ml_part_ptr,  # f32 [NS, T, h_q, 512], [NS, T, h_q], [NS, T, h_q] (log2 units)
    sink_ptr,
    out_ptr, stride_ot, stride_oh,
    ml_ptr, lse_ptr,
    skip_ptr,  # as the forward kernel's
    T, h_q, num_splits,
    BLOCK_H: tl.constexpr, NS_PAD: tl.constexpr, SB: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
    HAS_SINK: tl.constexpr, SKIP: tl.constexpr = -1,
):
    """Merge the split partials of ``BLOCK_H`` heads of one token over ``DC`` of the ``D`` output columns
    (program axis 2), ``SB`` splits per load (one memory round trip for up to SB splits; SB = 1: the plain
    loop over splits; SB = NS_PAD: every split's partial output loaded together with the lse, one memory round
    trip in all); the program of the first column chunk also writes lse and max_logits."""
    if SKIP >= 0:
        if tl.load(skip_ptr) == SKIP:
            return
    LN2: tl.constexpr = 0.6931471805599453
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < h_q
    d_chunk = tl.program_id(2)
    offs_s = tl.arange(0, NS_PAD)
    th = T * h_q
    part = offs_s[:, None].to(tl.int64) * th + t * h_q + offs_h[None, :]
    pmask = (offs_s[:, None] < num_splits) & hmask[None, :]
    offs_d = d_chunk * DC + tl.arange(0, DC)
    lse_s = tl.load(lse_part_ptr + part, mask=pmask, other=float("-inf"))
    if SB == NS_PAD:  # issued with the lse load: it does not wait for the max
        o_all = tl.load(o_part_ptr + part[:, :, None] * D + offs_d[None, None, :], mask=pmask[:, :, None], other=0.0)
    w_s, m_use, inv, lse, empty = merge_weights(lse_s, sink_ptr, offs_h, hmask, HAS_SINK)
    acc = tl.zeros([BLOCK_H, DC], tl.float32)
    if SB == NS_PAD:
        acc = tl.sum(w_s[:, :, None] * o_all, 0)
    elif SB == 1:
        for s in range(num_splits):
            off = s * th + t * h_q + offs_h
            w = tl.exp2(tl.load(lse_part_ptr + off, mask=hmask, other=float("-inf")) - m_use)
            o = tl.load(o_part_ptr + off[:, None] * D + offs_d[None, :], mask=hmask[:, None], other=0.0)
            acc += w[:, None] * o
    else:
        offs_sb = tl.arange(0, SB)
        for s0 in range(0, num_splits, SB):
            sp = s0 + offs_sb
            off = sp[:, None].to(tl.int64) * th + t * h_q + offs_h[None, :]  # [SB, BLOCK_H]
            ok = (sp[:, None] < num_splits) & hmask[None, :]
            w = tl.exp2(tl.load(lse_part_ptr + off, mask=ok, other=float("-inf")) - m_use[None, :])
            o = tl.load(o_part_ptr + off[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
            acc += tl.sum(w[:, :, None] * o, 0)
    o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc * inv[:, None]).to(tl.bfloat16), mask=hmask[:, None])
    if d_chunk == 0:
        ml_s = tl.load(ml_part_ptr + part, mask=pmask, other=float("-inf"))
        tl.store(lse_ptr + t * h_q + offs_h, lse, mask=hmask)
        tl.store(ml_ptr + t * h_q + offs_h, tl.where(empty, float("-inf"), tl.max(ml_s, 0) * LN2), mask=hmask)


def block_h_for(h_q: int) -> int:
    """Heads per program: the M dim of the dots (at least 16, at most 64)."""
    return min(64, next_power_of_2(max(h_q, 16)))


def _num_sms(device: torch.device) -> int:
    return backend.num_sms(device) or H200_NUM_SMS  # (cached there) the CPU interpreter: the H200's splits


_MAX_SPLITS = 64


def combine_config(T: int, h_q: int, num_splits: int, d_v: int = D_V) -> dict:
    """Launch shape of the split merge (:func:`_sparse_mla_combine_kernel`): programs of ``BLOCK_H`` heads x all
    ``DC`` = 512 columns, 2 heads (4 warps) up to 1024 (token, head) pairs, else 4 (2 warps); every split's partials
    loaded together with the lse, in one memory round trip (``SB`` = ``NS_PAD``), while that stays within 16K
    values per program, else ``SB`` splits per trip. Measured on the H200 (BENCHMARKS.md; the merge alone,
    ``benchmarks/bench_mla_combine.py``, CUDA graphs, us, the former rule (4 heads x 128 columns up to 256 pairs,
    else 16 heads and one split per trip) -> this one): T 32 x h_q 16, 4 splits 4.16 -> 2.60; T 32 x h_q 32 4.33 ->
    2.99; T 16 x h_q 16, 8 splits 4.68 -> 2.77; T 2 x h_q 128, 16 splits 5.15 -> 3.22; T 64 x h_q 128, 2 splits
    10.66 -> 7.26. Whole decode calls (s_q 1, 32K, CUDA graphs): bf16 h_q 16 batch 32 29.9 -> 28.0 us, fp8 h_q 16
    batch 32 28.3 -> 25.3, batch 16 18.5 -> 15.6; fp8 h_q 128 batch 1 x s_q 2 18.9 -> 16.5. (``NS_PAD`` follows
    the split count: padding it to share compiled variants across batch sizes cost 0.5-0.9 us at batch 1. Launched
    as a programmatic dependent of the split kernel, which let it go at its start: 0.6 us faster at h_q 128 batch 1,
    up to 1.6 us slower at batch 32; not used.)"""
    ns_pad = next_power_of_2(max(int(num_splits), 1))
    cb = 2 if T * h_q <= 1024 else 4
    return dict(BLOCK_H=cb, NS_PAD=ns_pad, SB=min(ns_pad, 16384 // (cb * d_v)), DC=d_v, num_warps=4 if cb == 2 else 2)


def choose_num_splits(T: int, head_groups: int, topk: int, num_sms: int, block_n: int,
                      per_sm: int | None = None) -> int:
    """Split-K factor: the largest power of two that keeps ``T * head_groups * splits`` within
    ``per_sm * num_sms`` programs (1 when the tiles alone reach it), each chunk at least two tiles
    of ``block_n`` rows, at most 64. ``per_sm`` defaults to 4 for tiles of <= 16 rows (they use
    less shared memory, so more fit, and each has less memory in flight), else 2; the launch code
    passes 1 for the 8-warp small-head fp8 programs (measured best on the H200)."""
    tiles = T * head_groups
    if per_sm is None:
        per_sm = 4 if block_n <= 16 else 2
    want = max(1, num_sms * per_sm // max(tiles, 1))
    want = 1 << (want.bit_length() - 1)
    k_tiles = cdiv(topk, block_n)
    return max(1, min(want, k_tiles // 2, _MAX_SPLITS))


def default_config(h_q: int, is_fp8: bool, T: int | None = None, target: tuple | None = None) -> dict:
    """Launch configuration: heads per program, gathered rows per tile, warps, pipeline stages,
    whether the raw fp8 tile is prefetched by hand (``prefetch``), programs per SM aimed at by the
    split-K choice (``per_sm``, None: :func:`choose_num_splits`' default).

    Chosen from sweeps on an H200 (benchmarks/sweep.py; BENCHMARKS.md has the numbers). Shared
    memory (sm_90, compiler report): BLOCK_H 64 / BLOCK_N 64 / bf16 / 3 stages holds q (72 KiB) and
    two tiles of 64 gathered rows (2 x 72 KiB): 217 KiB of the 227 KiB. Small head groups with the
    fp8 cache run on mma.sync, where Triton does not pipeline the fp8 loads: 8-warp programs that
    prefetch the next raw tile were fastest for h_q 32 at every batch and for h_q 16 at batch 1
    (24 against 39 us); at larger batches h_q 16 keeps small 2-warp programs (T = ``None``: those).
    On the GPU ``target`` (:func:`dsa.backend.gpu_target`) the entries of :data:`TARGET_CONFIGS` change them.
    """
    bh = block_h_for(h_q)
    if bh == 64:
        cfg = dict(block_h=64, block_n=64, num_warps=8, num_stages=2 if is_fp8 else 3, prefetch=False, per_sm=None)
    elif is_fp8 and (bh == 32 or (T is not None and T <= 8)):
        cfg = dict(block_h=bh, block_n=32, num_warps=8, num_stages=2, prefetch=True, per_sm=1)
    elif is_fp8:
        cfg = dict(block_h=16, block_n=16, num_warps=2, num_stages=2, prefetch=False, per_sm=None)
    else:
        cfg = dict(block_h=bh, block_n=64, num_warps=4, num_stages=3, prefetch=False, per_sm=None)
    changes = TARGET_CONFIGS.get(target)
    if changes:
        small_t = bool(is_fp8 and bh == 16 and T is not None and T <= 8)
        cfg.update(changes.get((bool(is_fp8), bh, small_t), {}))
    return cfg


#: the cases of :data:`TARGET_CONFIGS`: (fp8 cache, heads per program as :func:`block_h_for` gives them, 16-head
#: programs over the fp8 cache in a call of at most 8 tokens)
TARGET_CASES = [(False, 16, False), (False, 32, False), (False, 64, False),
                (True, 16, False), (True, 16, True), (True, 32, False), (True, 64, False)]

_MMA_SYNC_99K = {(False, 32, False): dict(block_n=32), (False, 64, False): dict(block_n=16),
                 (True, 64, False): dict(block_h=32, block_n=32)}

#: GPUs (:func:`dsa.backend.gpu_target`) that take other launch configurations than the H200's: per case of
#: :data:`TARGET_CASES`, what changes in :func:`default_config`'s configuration there. Chosen by compiling for the
#: target, not by timing (no such GPU was at hand): there the H200's configuration spills registers (0.4-2.9 KB per
#: thread for 64-head fp8 programs) or needs more shared memory than the GPU has, so each entry is the nearest
#: configuration that fits and spills at most a few registers: most heads per program, then most rows per tile, then
#: most pipeline stages, then the H200's warps, half or twice as many (``python tests/compile_targets.py TARGET
#: --search-mla`` finds them; ``tests/test_targets.py`` checks the kernels launched there). Ampere, Ada and consumer
#: Blackwell GPUs run the products on ``mma.sync``, whose A operand (q) stays in registers; AMD's CDNA GPUs give a
#: program of 8 wavefronts at most 256 registers each, of 4 wavefronts 512. On sm_100 (B200) only the bf16 programs
#: of 32 and 64 heads change.
TARGET_CONFIGS = {
    ("cuda", 80): {(False, 32, False): dict(num_warps=8), (True, 64, False): dict(block_h=32)},
    ("cuda", 86): _MMA_SYNC_99K,
    ("cuda", 89): _MMA_SYNC_99K,
    ("cuda", 100): {(False, 32, False): dict(num_warps=8), (False, 64, False): dict(num_stages=1)},
    ("cuda", 120): _MMA_SYNC_99K,
    ("cuda", 121): _MMA_SYNC_99K,
    ("hip", "gfx90a"): {(False, 16, False): dict(num_stages=1), (False, 32, False): dict(num_stages=1),
                        (False, 64, False): dict(block_n=32, num_warps=4, num_stages=1),
                        (True, 32, False): dict(num_warps=4),
                        (True, 64, False): dict(block_n=16, num_warps=4, num_stages=1)},
    ("hip", "gfx942"): {(False, 16, False): dict(num_stages=1), (False, 32, False): dict(num_stages=1),
                        (False, 64, False): dict(num_warps=4, num_stages=1),
                        (True, 32, False): dict(num_warps=4),
                        (True, 64, False): dict(block_n=16, num_warps=4, num_stages=1)},
    ("hip", "gfx950"): {(False, 32, False): dict(num_stages=2), (False, 64, False): dict(num_warps=4, num_stages=1),
                        (True, 32, False): dict(num_warps=4),
                        (True, 64, False): dict(block_n=16, num_warps=4, num_stages=1)},
}


def fitting_configs(cfg: dict) -> list:
    """``cfg`` and smaller launch configurations of the portable kernel, for :func:`dsa._host.launch_fitting`:
    one pipeline stage less at a time, then half the gathered rows per tile, then half the heads per program
    (down to 16 of each). The H200's configurations need up to 217 KiB of shared memory; sm_86/89/120 GPUs
    offer 99 KiB per block and MI300 64 KiB."""
    out = [dict(cfg)]
    c = dict(cfg)
    while c["num_stages"] > 1:
        c = dict(c, num_stages=c["num_stages"] - 1)
        out.append(c)
    while c["block_n"] > 16:
        c = dict(c, block_n=c["block_n"] // 2)
        out.append(c)
    while c["block_h"] > 16:
        c = dict(c, block_h=c["block_h"] // 2, num_warps=max(2, c["num_warps"] // 2))
        out.append(c)
    return out


#: 16/32-head groups on sm_90: the Gluon kernel (:mod:`dsa.mla.kernel_sm90`, the gathered rows as the M
#: dimension of both products; one program per SM), taken by default wherever it is supported. Measured on the
#: H200 in one run (BENCHMARKS.md, sixth session; CUDA graphs, s_q 1, 32K contexts): fp8 h_q 16 at batch 64 58.5 us
#: against 103.4 for the small-head Triton programs; bf16 h_q 16 at batch 128 76.0 against 88.3; bf16 prefill h_q 16
#: 1.88 against 2.08 ms.
SM90_ROWS_SMALL_HEADS = dict(block_n=64, num_warps=4, num_stages=2, prefetch=False, per_sm=1, rows=True)
#: ...and a 32-head group with at most this many tokens runs as two 16-head groups (twice the programs, each
#: with half the MMA work; the rows are gathered twice, from L2 the second time). H200, CUDA graphs, s_q 1, 32K:
#: batch 1 fp8 13.5 -> 12.2 us, bf16 11.8 -> 9.8; batch 4 14.1 -> 12.7, 12.5 -> 10.7; from batch 16 on (fp8) or
#: 32 (bf16) one 32-head group is faster (fp8 batch 16 23.6 against 27.9 us).
SM90_TWO_GROUPS_MAX_T = 4


def cluster_size(num_splits: int, programs: int, block_h: int, num_sms: int, force: bool = False,
                 max_clusters=None) -> int:
    """Cluster size for the split merge inside the Hopper kernel (the ``num_splits`` splits of each of the
    ``programs`` (token, head group) pairs as one cluster of CTAs; no merge kernel), or 0 for the merge kernel.
    The split count rounded up to a power of two (the extra splits are empty), at most 16 CTAs (the largest,
    non-portable cluster; 8 on GPUs with fewer than 132 SMs). Taken for 16/32-head groups when the clusters run
    in one wave: clusters of 2, or at most ``max_clusters(n)`` clusters of ``n`` (the GPU's count of clusters that
    run at once, :func:`dsa.mla.kernel_sm90.max_active_clusters`; None or not given: ``num_sms // 2`` CTAs).
    ``force``: whenever the size allows (tests, benchmarks).

    Measured on the H200 (BENCHMARKS.md; CUDA graphs, s_q 1, 32K context, µs, merge kernel -> in-kernel merge):
    fp8 h_q 16 batch 1 12.1 -> 10.2, batch 64 (2 splits) 58.1 -> 55.9; bf16 h_q 16 batch 1 9.8 -> 8.3 (the first
    rule, ``num_sms // 2`` CTAs). The H200 runs at most 66 / 30 / 15 / 7 clusters of 2 / 4 / 8 / 16 CTAs of one CTA
    per SM; one more takes a second wave (twenty-third session): h_q 16 batch 8 (16 splits: 8 clusters) bf16 10.3
    -> 16.1, fp8 10.9 -> 17.5; batch 16 (8 splits) 13.7 -> 21.6, 15.5 -> 26.2; batch 31-32 (4 splits) 28.2 ->
    39.7, 25.5 -> 44.2; 64-head groups (several merge rounds per CTA) at batch 1 16.1 -> 19.9 (bf16 h_q 128, s_q 2).
    Within that count (taken since then): h_q 16 batch 5 / 6 (16 splits) bf16 9.4 / 9.6 -> 8.9 / 8.9, fp8 10.4 /
    10.4 -> 9.5 / 9.5; batch 12 (8 splits) 12.4 -> 11.5, 14.9 -> 13.6; batch 20 / 28 / 30 (4 splits) 19.1 / 25.5 /
    26.8 -> 18.2 / 24.1 / 25.7, 23.5 / 24.3 / 24.7 -> 21.9 / 23.0 / 23.5; h_q 32 within -0.4 / +0.4 µs."""
    n = next_power_of_2(max(int(num_splits), 1))
    if kernel_sm90 is None or n < 2 or n > (kernel_sm90.MAX_CLUSTER if num_sms >= 132 else 8):
        return 0
    if force or n == 2 and block_h < 64:
        return n
    fits = max_clusters(n) if max_clusters is not None else None
    if block_h < 64 and (programs <= fits if fits is not None else programs * n <= num_sms // 2):
        return n
    return 0


#: the index lists are grouped by slot range first (:mod:`dsa.mla.order`) for calls of at least this many tokens
#: in one split over a cache of at least this many bytes (see :func:`order_pays`).
ORDER_MIN_T = 512
ORDER_MIN_CACHE_BYTES = 128 << 20
#: grouped lists in serpentine order (``order_indices``' ``wave``: one wave = one program per SM, as the Hopper
#: kernels run, in an unsplit launch; the rows of odd waves take their ranges from the top down; never for the
#: portable kernel, whose programs per SM vary). Off: measured (BENCHMARKS.md, forty-sixth session, 4096 tokens,
#: the grouping included) against 4 plain ranges it moved -0.4 / -2.2 points at h_q 16 and +2.5 / -1.2 at h_q 32 on
#: the H200, -2.0 at h_q 32 and +0.3 at h_q 128 on an H100: within the rounds' noise, although it reads 14% less
#: from DRAM (the grouped kernel is latency-bound).
ORDER_SERPENTINE = False


def _serpentine_wave(dev, one_per_sm: bool) -> int:
    """``order_indices``' ``wave`` for an unsplit launch: the programs resident at once where that is one per SM
    (``one_per_sm``: the Hopper kernels serve the call) and :data:`ORDER_SERPENTINE` is on, else 0 (plain ranges)."""
    return _num_sms(dev) if ORDER_SERPENTINE and one_per_sm else 0


def order_pays(T: int, num_splits: int, topk: int, S: int, row_bytes: int) -> bool:
    """Whether :func:`sparse_mla_triton` groups the index lists first: one split, at least ``ORDER_MIN_T`` tokens
    (decode batches, whose requests read disjoint parts of the cache, gained nothing: 0.9% slower at T 256, h_q 128,
    call 6; 3.6% at h_q 16 with an earlier, 85 us form of the kernel, call 4), a cache of ``ORDER_MIN_CACHE_BYTES``
    or more (smaller ones lost in call 4: bf16 32K rows 5% at h_q 16, fp8 128K rows 3.5%), more than one tile of
    entries and at most :data:`~dsa.mla.order.MAX_ORDER_TOPK`. Measured on the H200, BENCHMARKS.md fifteenth session (bf16 prefill,
    T 4096, topk 2048 of 128K, 4 ranges, the grouping included: h_q 16 -11.4%, 32 -8.5%, 128 -0.1% (call 9);
    h_q 64 -6.2%, T 512 h_q 16 -10.1% (call 6))."""
    return (num_splits == 1 and T >= ORDER_MIN_T and 64 < topk <= MAX_ORDER_TOPK
            and S * row_bytes >= ORDER_MIN_CACHE_BYTES)


#: calls with more than 64 heads, not a multiple of 64, whose last 64-head group would be at least half masked heads
#: (h_q % 64 in 1..32: 72, 80, 88, 96) run as two calls, the 64-head groups and the rest as a small group of its own
#: (:func:`slice_pays`), from this many query tokens on (keyed by "fp8_ds_mla"): there a masked head costs about
#: what a real one does, while the second call reads the rows again. Measured on the H200 (BENCHMARKS.md,
#: thirty-seventh session; CUDA graphs, topk 2048, each token its own request; one call -> two, us): fp8 h_q 72 / 96
#: batch 128 228.0 -> 211.8 / 229.4 -> 232.7, 256 447.3 -> 369.1 / 467.6 -> 435.1, 2048 3671 -> 3039 / 3843 -> 3563;
#: bf16 batch 256 319.7 -> 349.8 / 332.8 -> 361.2, 512 652.2 -> 650.2 / 713.8 -> 684.0, 2048 3004 -> 2615 / 3051 ->
#: 2816; bf16 prefill (4096 tokens, topk 2048 of 128K, do_bench) h_q 72 / 80 / 96 5407 -> 4504 / 5432 -> 4532 / 5597
#: -> 5178.
SLICE_MIN_T = {False: 512, True: 256}


def slice_pays(T: int, h_q: int, is_fp8: bool) -> bool:
    """Whether :func:`sparse_mla_triton` runs the call's heads as two slices, ``[0, 64 k)`` and the rest (see
    :data:`SLICE_MIN_T`)."""
    return h_q > 64 and 0 < h_q % 64 <= 32 and T >= SLICE_MIN_T[bool(is_fp8)]


#: many-token calls over the fp8_ds_mla cache with more than 16 heads, on Hopper, run on a bf16 copy: of the whole cache
#: where it is small enough, else of the pages the call reads (:mod:`dsa.mla.compact`; an engine's pool is far larger
#: than the contexts of one prefill). The copy holds the values the kernels' producers would compute, and the call
#: runs on it with the bf16 kernels: one producer warpgroup copying rows beside the math (64 heads: the ping-pong
#: schedule), where the fp8 ones run two dequantising. Measured on an H100 (BENCHMARKS.md, fifty-third and fifty-fourth
#: sessions; 4096 tokens x topk 2048, do_bench, µs, fp8 kernels -> bf16 kernels on the copy, the copy not included):
#: over a context of 16K / 32K / 128K / 192K / 256K rows at h_q 32 2356 -> 1661 / 2384 -> 1782 / 2442 -> 2024 / 2439 ->
#: 2367 / 2479 -> 2468; h_q 64 over 64K / 256K / 384K 3595 -> 2812 / 3791 -> 3082 / 3834 -> 3310; h_q 128 6966 -> 4824
#: / 7127 -> 5040 / 7159 -> 5103; 1024 tokens over 16K rows: h_q 32 / 64 / 128 616 -> 436 / 876 -> 588 / 1712 -> 1130.
#: But h_q 16 1713.5 -> 1998.2 with the copy (so never for 16 heads). The whole cache's copy takes about 0.7 µs per
#: 1K rows (92 µs for 128K). So the bf16 kernels gain less as each cache row is gathered fewer times: at 32 heads
#: nothing left at 32 gathered rows per copied row (256K), and at 43 less than a copy costs; at 64 and 128 heads they
#: gain 14% / 29% at 21 (384K). More than 64 heads (two head groups) gain at fewer: 1024 tokens at h_q 128 over the
#: pages of 128K / 192K / 256K (16 / 10.7 / 8 rows per copied row; fifty-sixth session, H100, copy included) 1815 ->
#: 1449 / 1838 -> 1535 / 1850 -> 1587. At 32 heads the pages of 192K / 256K lose (2457 -> 2742 / 2490 -> 2893), at 64
#: they gain 7.6% / 1.4% / 0.7% at 32 / 28.4 / 25.6 and lose 0.5% at 21.3 (4096 tokens). Hence at least
#: ``DEQUANT_FIRST_MIN_RATIO[_ratio_key(h_q)]`` gathered rows per copied row, at most :data:`DEQUANT_FIRST_MAX_BYTES`
#: of copy, and at least ``ORDER_MIN_T`` tokens (:func:`dequant_first_pays`).
DEQUANT_FIRST_MIN_RATIO = {32: 64, 64: 16, 128: 8}
DEQUANT_FIRST_MAX_BYTES = 512 << 20
#: a copy of the pages a call reads (:func:`dsa.mla.compact.compact`) costs passes over the index lists (marking the
#: pages: 30-61 µs for 1024-4096 x 2048 entries on an H100; the remap 12-30) before the copy, whether it is then taken
#: or not: its size is known on the device only, so the copy is allocated at :func:`dequant_first_max_rows` and both the
#: call over it and the call over the cache are queued, a device flag skipping one (no synchronisation). On an H100
#: (fifty-fifth session; topk 2048 over a context of C rows at random pages of a 2M-row pool, do_bench medians, µs, fp8
#: kernels -> as dispatched), 4096 tokens: h_q 128 over C = 16K / 128K / 384K 6577 -> 4612 / 7063 -> 5122 / 7163 ->
#: 5592, h_q 64 3400 -> 2545 / 3712 -> 3012 / 3839 -> 3855 (21 gathered rows per copied row: even), h_q 32 over 16K /
#: 128K 2368 -> 1855 / 2905 -> 2265 (the pages' way forced), and over 384K (above the bound: not taken) 2727 -> 2603;
#: 2048 tokens: h_q 32 over 16K 1212 -> 967, but over 128K (not taken) 1237 -> 1352; 1024 tokens: h_q 128 over 16K /
#: 128K 1695 -> 1245 / 1834 -> 1434, h_q 64 871 -> 705-995 / 952 -> 889 (forced; rounds apart). A copy not taken costs
#: the marking and the skipped launches, about 115 µs at 2048 tokens. Hence at least this many tokens x heads (32 heads:
#: 4096 tokens; 64: 2048; 128: 1024), where the whole cache makes too big a copy or too many rows per entry.
DEQUANT_FIRST_PAGES_MIN_WORK = 131072


def _ratio_key(h_q: int) -> int:
    """:data:`DEQUANT_FIRST_MIN_RATIO`'s key for ``h_q`` heads: the head group's size, or 128 past one 64-head group."""
    return 128 if h_q > 64 else block_h_for(h_q)


def dequant_first_max_rows(T: int, h_q: int, topk: int) -> int:
    """The most rows of a bf16 copy that a call of ``T`` tokens with ``h_q`` heads and ``topk`` entries each over an
    fp8_ds_mla cache runs on instead, on Hopper (0: none; see :data:`DEQUANT_FIRST_MIN_RATIO`)."""
    ratio = DEQUANT_FIRST_MIN_RATIO.get(_ratio_key(h_q))
    if ratio is None or T < ORDER_MIN_T:
        return 0
    return min(T * topk // ratio, DEQUANT_FIRST_MAX_BYTES // (D_QK * 2))


def dequant_first_pays(T: int, h_q: int, topk: int, rows: int) -> bool:
    """Whether such a call runs on a bf16 copy of ``rows`` of its rows (:func:`dequant_first_max_rows`)."""
    return 0 < rows <= dequant_first_max_rows(T, h_q, topk)


def _dequant_first(q, kv, indices) -> str | None:
    """How an fp8_ds_mla call (``kv`` the flat ``[S, 656]`` view) runs on a bf16 copy where the Hopper kernels serve it:
    ``"whole"``, a copy of the whole cache (:func:`dequant_first_pays` for ``S`` rows); ``"pages"``, a copy of the
    pages the call reads (:mod:`dsa.mla.compact`), where their number, known on the device only, then meets
    :func:`dequant_first_pays`, tried as :data:`DEQUANT_FIRST_PAGES_MIN_WORK` says (not where the heads would be
    sliced, :func:`slice_pays`: the two launches of the pages' way take one group each); ``None``: no copy."""
    T, h_q, _ = q.shape
    topk, S = indices.shape[1], kv.shape[0]
    # (the shapes first: decode calls, the most frequent, stop at the token count)
    if not dequant_first_pays(T, h_q, topk, 1) or kernel_sm90 is None or not kernel_sm90.supported(q, kv, 64):
        return None
    if dequant_first_pays(T, h_q, topk, S):
        return "whole"
    if T * h_q >= DEQUANT_FIRST_PAGES_MIN_WORK and not slice_pays(T, h_q, True) and not slice_pays(T, h_q, False):
        return "pages"
    return None


def _sliced_heads(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, num_splits, config, order):
    """The call as two: heads ``[0, 64 k)`` (whole 64-head groups) and ``[64 k, h_q)`` (one small group), each into
    its columns of ``out``; their max_logits and lse copied into the call's. The index lists are grouped once for
    both when :func:`order_pays` (``order`` None)."""
    T, h_q, _ = q.shape
    S, topk = kv.shape[0], indices.shape[1]
    out, max_logits, lse = outputs(T, h_q, d_v, q.device, out)
    if order is None and order_pays(T, 1, topk, S, kv.shape[1] * kv.element_size()):
        wave = _serpentine_wave(q.device, kernel_sm90 is not None and kernel_sm90.supported(q, kv, 64))
        indices, order = order_indices(indices, S, topk_length, wave=wave), False
    config = {k: v for k, v in (config or {}).items() if k != "slice_heads"} or None
    h_main = h_q // 64 * 64
    for a, b in ((0, h_main), (h_main, h_q)):
        sink = None if attn_sink is None else attn_sink[a:b]
        _, ml, ls = sparse_mla_triton(q[:, a:b], kv, indices, sm_scale, d_v, sink, topk_length, out[:, a:b],
                                      num_splits, config, order)
        max_logits[:, a:b].copy_(ml)
        lse[:, a:b].copy_(ls)
    return out, max_logits, lse


def sparse_mla_triton(q, kv, indices, sm_scale, d_v=D_V, attn_sink=None, topk_length=None, out=None,
                      num_splits: int | None = None, config: dict | None = None, order: bool | int | None = None,
                      skip: tuple[torch.Tensor, int] | None = None, results: tuple | None = None):
    """Launch the kernels on validated arguments (see :func:`dsa.sparse_mla`).

    ``kv`` is the flat ``[S, 576]`` bf16 or ``[S, 656]`` uint8 view; ``num_splits`` forces the
    split-K factor (``None``: chosen here from the shapes and the device's SM count); ``config``
    overrides entries of :func:`default_config` (tests and benchmarks only; ``gluon=False`` keeps the
    portable Triton kernel where :mod:`dsa.mla.kernel_sm90` would serve the call; ``producer=`` overrides
    that kernel's :data:`~dsa.mla.kernel_sm90.PRODUCER` entries; ``pingpong=True/False`` picks its ping-pong
    schedule for 64-head groups over the bf16 cache or not; ``persist=True/False`` runs an unsplit ping-pong launch as
    persistent programs, one per SM, or one program per item (default: :data:`~dsa.mla.kernel_sm90.PERSIST` for
    h_q > 64); ``cluster=False`` keeps the merge kernel after its split-K, ``cluster=True`` merges inside it
    whenever the cluster size allows (:func:`cluster_size`); ``rows=True`` with a 16/32-head group takes it with the
    gathered rows as the M dimension; ``bulk=True/False`` takes :mod:`dsa.mla.kernel_bulk` wherever
    it applies, or never; ``slice_heads=True/False`` runs more than 64 heads as two slices, the 64-head groups and
    the rest (:func:`_sliced_heads`), or not). Without ``config``, small head groups on sm_90 take that kernel where
    it is supported, and 1-16-head decode over the fp8 cache :mod:`dsa.mla.kernel_bulk` where
    :func:`dsa.mla.kernel_bulk.serves` says so (not with a forced ``num_splits``, unless ``bulk=True``), on sm_90
    many-token calls over the fp8_ds_mla cache run on a bf16 copy of it where :func:`dequant_first_pays` says so
    (not with a forced ``num_splits``), and on sm_90 the heads are sliced where :func:`slice_pays` says so. ``order``
    forces the index lists grouped by slot range
    first (:mod:`dsa.mla.order`; ``True``: :data:`~dsa.mla.order.DEFAULT_BUCKETS` ranges, an int: that
    many) or not (``False`` / 0; ``None``: :func:`order_pays`).

    ``skip = (flag, value)`` (``flag`` ``[1]`` int32 on the device) makes every kernel of the call return at once,
    writing nothing, where ``flag`` holds ``value``, and ``results = (out, max_logits, lse)`` are written instead of
    new ones: the pages' way queues the call over the copy and over the cache this way, and the flag picks one on the
    device. Such a call takes neither a copy, nor the bulk kernel, nor slices.
    """
    T, h_q, _ = q.shape
    topk = indices.shape[1]
    S = kv.shape[0]
    dev = q.device
    is_fp8 = kv.dtype == torch.uint8
    bulk = (config or {}).get("bulk")
    if skip is None and kernel_bulk is not None and bulk is not False and kernel_bulk.applies(q, kv, indices, out):
        if bulk or (not config and num_splits is None and kernel_bulk.serves(T, topk)):
            return kernel_bulk.sparse_mla_bulk(q, kv, indices, sm_scale, attn_sink, topk_length, out, num_splits)
    way = None
    if skip is None and is_fp8 and not config and num_splits is None and T > 0:
        way = _dequant_first(q, kv, indices)
    if way == "whole":
        from ..mla_cache.kernel import fp8_ds_mla_read

        kv16 = torch.empty(S, D_QK, dtype=torch.bfloat16, device=dev)
        fp8_ds_mla_read(kv, kv16)
        return sparse_mla_triton(q, kv16, indices, sm_scale, d_v, attn_sink, topk_length, out, None, None, order)
    if way == "pages":  # both calls queued, the flag (pages found, within the rule) taking one: no synchronisation
        copy, lists, taken = compact(kv, indices, topk_length, dequant_first_max_rows(T, h_q, topk))
        results = outputs(T, h_q, d_v, dev, out)
        sparse_mla_triton(q, copy, lists, sm_scale, d_v, attn_sink, topk_length, None, None, None, order,
                          skip=(taken, 0), results=results)
        sparse_mla_triton(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, None, None, None, order,
                          skip=(taken, 1), results=results)
        return results
    sliced = (config or {}).get("slice_heads")
    if skip is None and sliced is not False and h_q > 64 and h_q % 64 and (
            sliced or (not config and kernel_sm90 is not None and kernel_sm90.supported(q, kv, 64)
                       and slice_pays(T, h_q, is_fp8))):
        return _sliced_heads(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out, num_splits, config, order)
    out, max_logits, lse = outputs(T, h_q, d_v, dev, out) if results is None else results
    if T == 0:
        return out, max_logits, lse
    fp8_mode = backend.fp8_mode(dev)
    if is_fp8:
        nope, scales, rope = fp8_ds_mla_views(kv)
        stride_scale = scales.stride(0)
    else:
        nope, rope = kv[:, :KV_LORA_RANK], kv[:, KV_LORA_RANK:D_QK]
        scales, stride_scale = kv, 0  # unused
    cfg = default_config(h_q, is_fp8, T, backend.gpu_target(dev))
    config = {k: v for k, v in (config or {}).items() if k != "bulk"}
    if not config and kernel_sm90 is not None and cfg["block_h"] < 64 and kernel_sm90.supported(q, kv, cfg["block_h"]):
        cfg.update(SM90_ROWS_SMALL_HEADS)
        if cfg["block_h"] == 32 and T <= SM90_TWO_GROUPS_MAX_T:
            cfg["block_h"] = 16
    cfg.update(config or {})
    forced_splits = num_splits

    def run(cfg):
        bh, bn, warps, stages = cfg["block_h"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
        n_hg = cdiv(h_q, bh)
        num_splits = forced_splits
        if num_splits is None:
            num_splits = choose_num_splits(T, n_hg, topk, _num_sms(dev), bn, cfg.get("per_sm"))
        num_splits = max(1, min(int(num_splits), cdiv(max(topk, 1), bn)))
        split_len = cdiv(cdiv(max(topk, 1), bn), num_splits) * bn
        num_splits = cdiv(max(topk, 1), split_len)
        order_ = order
        if order_ is None:
            order_ = order_pays(T, num_splits, topk, S, kv.shape[1] * kv.element_size())
        # Hopper: the Gluon kernel for 64-head groups, and for 16/32-head groups with ``rows``
        use_sm90 = (kernel_sm90 is not None and cfg.get("gluon", True) and kernel_sm90.supported(q, kv, bh)
                    and bn == kernel_sm90.BLOCK_N and (bh == kernel_sm90.BLOCK_H or bool(cfg.get("rows", False))))
        idx = indices
        if order_:
            idx = order_indices(indices, S, topk_length, DEFAULT_BUCKETS if order_ is True else int(order_),
                                wave=_serpentine_wave(dev, use_sm90) if num_splits == 1 else 0, groups=n_hg,
                                skip=skip)
        has_len = topk_length is not None
        has_sink = attn_sink is not None
        dummy = lse
        skip_arg, skip_value = (dummy, -1) if skip is None else (skip[0], int(skip[1]))
        common = dict(BLOCK_H=bh, BLOCK_N=bn, IS_FP8=is_fp8, HAS_LEN=has_len, HAS_SINK=has_sink,
                      GROUP=FP8_DS_MLA_GROUP, D_ROPE=ROPE_DIM, PREFETCH=bool(cfg.get("prefetch", False)) and is_fp8,
                      FP8_MODE=fp8_mode, SKIP=skip_value,
                      num_warps=warps, num_stages=stages)
        len_arg = topk_length if has_len else dummy
        sink_arg = attn_sink if has_sink else dummy
        # without Triton's e4m3fn type (fp8_native False) the portable kernel takes the fp8 values as bytes
        nope_in = nope.view(torch.uint8) if is_fp8 and fp8_mode else nope
        args_in = (q, q.stride(0), q.stride(1), nope_in, nope.stride(0), scales, stride_scale, rope, rope.stride(0),
                   idx, idx.stride(0), len_arg, sink_arg)
        scale_log2 = float(sm_scale) * _LOG2E

        def fwd(grid, o, s_ot, s_oh, s_os, ml, ls, split, cluster=0):
            if use_sm90:
                kernel_sm90.launch(grid, q, nope, scales, stride_scale, rope, idx, len_arg, sink_arg, o, s_ot, s_oh,
                                   s_os, ml, ls, T, h_q, S, topk, split_len, scale_log2, has_len, has_sink, split,
                                   block_h=bh, producer=cfg.get("producer"), pingpong=cfg.get("pingpong"),
                                   cluster=cluster, final=(out, out.stride(0), out.stride(1), max_logits, lse),
                                   num_sms=_num_sms(dev), persist=cfg.get("persist"), skip=skip)
            else:
                _sparse_mla_fwd_kernel[grid](*args_in, o, s_ot, s_oh, s_os, ml, ls, skip_arg,
                                             T, h_q, S, topk, split_len, scale_log2, SPLIT=split, **common)

        if num_splits == 1:
            fwd((T * n_hg, 1), out, out.stride(0), out.stride(1), 0, max_logits, lse, False)
            return out, max_logits, lse
        cluster = 0
        if use_sm90 and cfg.get("cluster", True) is not False:
            dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
            cluster = cluster_size(num_splits, T * n_hg, bh, _num_sms(dev), force=cfg.get("cluster") is True,
                                   max_clusters=lambda n: kernel_sm90.max_active_clusters(n, dev_index))
        ns_alloc = max(num_splits, cluster)
        o_part = torch.empty(ns_alloc, T, h_q, d_v, dtype=torch.float32, device=dev)
        lse_part = torch.empty(ns_alloc, T, h_q, dtype=torch.float32, device=dev)
        ml_part = torch.empty(ns_alloc, T, h_q, dtype=torch.float32, device=dev)
        if cluster:  # the splits of each (token, head group) as one cluster, merged inside the kernel
            fwd((T * n_hg, 1), o_part, h_q * d_v, d_v, T * h_q * d_v, ml_part, lse_part, True, cluster)
            return out, max_logits, lse
        fwd((T * n_hg, num_splits), o_part, h_q * d_v, d_v, T * h_q * d_v, ml_part, lse_part, True)
        mc = combine_config(T, h_q, num_splits, d_v)
        _sparse_mla_combine_kernel[(T, cdiv(h_q, mc["BLOCK_H"]), cdiv(d_v, mc["DC"]))](
            o_part, lse_part, ml_part, attn_sink if has_sink else dummy, out, out.stride(0), out.stride(1),
            max_logits, lse, skip_arg, T, h_q, num_splits, D=d_v, HAS_SINK=has_sink, SKIP=skip_value, **mc)
        return out, max_logits, lse

    if config:  # (tests, benchmarks) as given
        return run(cfg)
    # the H200's configuration first; on GPUs with less shared memory, fewer stages, then smaller tiles
    return launch_fitting(("sparse_mla", dev, is_fp8, tuple(sorted(cfg.items()))), fitting_configs(cfg), run)
