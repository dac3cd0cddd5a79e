"""Sparse MLA on Hopper (sm_90), written in Gluon; both cache formats. Two kernels: 64-head groups
(below), and 16/32-head groups (:func:`_sparse_mla_sm90_rows_kernel`: one warpgroup, the gathered rows
as the M dimension of both products, S^T = K q^T and O^T = V^T P^T, with the same copies, dequantisation
and epilogue; 4 warps and 132-185 KiB of shared memory, one program per SM).

Why a second kernel: the portable Triton kernel (:mod:`dsa.mla.kernel`) cannot place work on
warpgroups. For the chained QK -> PV dots of a 64-head group Triton lays the logits over both
warpgroups as ``warpsPerCTA=[8, 1]``, so each warpgroup computes the whole 64 x 64 x 576 QK
product (1.5x the useful MMA work). This kernel is the same algorithm with the work placed by hand
(FlashMLA's split of the two products over two warpgroups, without producer warps):

* One program = 64 heads of one query token, 8 warps = two warpgroups, one CTA per SM.
* Each tile of 64 gathered cache rows is copied into shared memory once with ``cp.async`` (invalid
  entries zero-filled and never read: NaN in unused slots cannot leak). bf16 cache: two tile
  buffers, tile i+1's copies issued while tile i's QK runs. fp8_ds_mla: the raw fp8 values of tile
  i+1 go to a staging buffer (their group scales to registers) while tile i is used, and are
  dequantised once (fp8 x scale in fp32, rounded to bf16, as the Triton kernel and the reference do)
  into the one bf16 tile that both products read; the bf16 rope part is copied directly.
* QK: ``S [64 heads, 64 rows]`` with ``warps_per_cta=[4, 2]``: each warpgroup computes the logits of
  32 of the 64 rows (wgmma m64n32k16, q in shared memory), no duplicated work. The row max goes
  through the compiler's cross-warp reduction; row sums are kept per column and reduced once at the end.
* P (bf16) goes to shared memory once; PV: ``O [64, 512]`` with ``warps_per_cta=[4, 2]``: each
  warpgroup accumulates 256 of the 512 output columns from the same tile (the V operand is the first
  512 columns of the gathered rows, no second copy).
* Online softmax in fp32 with exp2, the same epilogue as the Triton kernel (partials for split-K).

Shared memory: q 72 KiB + 2 x 72 KiB of rows + 8 KiB of P = 224 KiB (bf16); q + one bf16 tile +
2 x 8 KiB of rope + 32 KiB of raw fp8 + P = 192 KiB (fp8).

Measured on the H200 and dropped (BENCHMARKS.md): an L2 bulk prefetch of the rows one or two tiles
ahead of the copies (20% slower), two raw fp8 buffers with tile i+1's copies issued before tile i's
dequantisation (12% slower), P.V of one tile left in flight into the next (16% slower). Within a tile everything is serialised (copies wait, QK, softmax, P.V);
overlapping them needs warp specialisation (producer warps, warpgroups taking turns), not done yet.

Gluon kernels do not run under ``TRITON_INTERPRET``: this one is tested on the GPU against the
reference and against the Triton kernel (tests/test_mla.py, ``test_gpu_sm90_*``); the CPU CI tests
the Triton kernel, which stays the path everywhere else.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .epilogue import row_stats

BLOCK_H = 64
BLOCK_N = 64
NUM_WARPS = 8


@gluon.jit
def _tile_rows(idx_row, n0, stop, S, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Index-list entries ``[n0, n0 + BLOCK_N)`` as (valid, int64 row) vectors in ``layout``."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout)
    idx = gl.load(idx_row + offs_n, mask=offs_n < stop, other=-1)
    valid = (offs_n < stop) & (idx >= 0) & (idx < S)
    return valid, gl.where(valid, idx, 0).to(gl.int64)


@gluon.jit
def _issue_tile(nope_smem, rope_smem, nope_ptr, stride_nope, rope_ptr, stride_rope, valid, rows,
                DV: gl.constexpr, DR: gl.constexpr, cp_l: gl.constexpr):
    """cp.async the gathered rows into one buffer (zero-filled where invalid: those are never read)."""
    cols = gl.arange(0, DV, gl.SliceLayout(0, cp_l))
    # row offsets: multiples of 16 bytes (the launcher checks the strides)
    cp.async_copy_global_to_shared(nope_smem, nope_ptr + gl.multiple_of(rows * stride_nope, 8)[:, None] + cols[None, :],
                                   mask=valid[:, None])
    cols_r = gl.arange(0, DR, gl.SliceLayout(0, cp_l))
    cp.async_copy_global_to_shared(rope_smem, rope_ptr + gl.multiple_of(rows * stride_rope, 8)[:, None] + cols_r[None, :],
                                   mask=valid[:, None])
    cp.commit_group()


@gluon.jit
def _issue_tile_fp8(raw_smem, rope_smem, nope_ptr, stride_nope, scale_ptr, stride_scale, rope_ptr, stride_rope,
                    valid, rows, DV: gl.constexpr, DR: gl.constexpr, cp8_l: gl.constexpr, cp_l: gl.constexpr):
    """fp8_ds_mla: cp.async the raw fp8 values into the raw buffer and the bf16 rope part into ``rope_smem``
    (zero-filled where invalid); return the rows' four group scales (plain loads, used one iteration later)."""
    cols = gl.arange(0, DV, gl.SliceLayout(0, cp8_l))
    cp.async_copy_global_to_shared(raw_smem, nope_ptr + gl.multiple_of(rows * stride_nope, 16)[:, None]
                                   + cols[None, :], mask=valid[:, None])
    valid_r = gl.convert_layout(valid, gl.SliceLayout(1, cp_l))
    rows_r = gl.convert_layout(rows, gl.SliceLayout(1, cp_l))
    cols_r = gl.arange(0, DR, gl.SliceLayout(0, cp_l))
    cp.async_copy_global_to_shared(rope_smem, rope_ptr + gl.multiple_of(rows_r * stride_rope, 8)[:, None]
                                   + cols_r[None, :], mask=valid_r[:, None])
    cp.commit_group()
    sb = scale_ptr + rows * stride_scale
    s0 = gl.load(sb + 0, mask=valid, other=0.0)
    s1 = gl.load(sb + 1, mask=valid, other=0.0)
    s2 = gl.load(sb + 2, mask=valid, other=0.0)
    s3 = gl.load(sb + 3, mask=valid, other=0.0)
    return s0, s1, s2, s3


@gluon.jit
def _dequant_group(raw_smem, kn_smem, sc, g: gl.constexpr, cp8_l: gl.constexpr):
    """Values ``[128 g, 128 (g + 1))`` of the raw tile times their per-row scale, as bf16 into the tile."""
    raw = raw_smem.slice(g * 128, 128, dim=1).load(cp8_l)
    kn_smem.slice(g * 128, 128, dim=1).store((raw.to(gl.float32) * sc[:, None]).to(gl.bfloat16))


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
def _issue(raw_smem, k_nope_smem, rope_smem, nbuf, nope_ptr, stride_nope, scale_ptr, stride_scale, rope_ptr,
           stride_rope, valid, rows, IS_FP8: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, cp_l: gl.constexpr,
           cp8_l: gl.constexpr):
    """One tile's copies: bf16 into buffer ``nbuf`` of the tile; fp8_ds_mla into the raw buffer, returning
    the rows' group scales (zeros for bf16)."""
    if IS_FP8:
        s0, s1, s2, s3 = _issue_tile_fp8(raw_smem, rope_smem, nope_ptr, stride_nope, scale_ptr, stride_scale,
                                         rope_ptr, stride_rope, valid, rows, DV, DR, cp8_l, cp_l)
    else:
        _issue_tile(k_nope_smem.index(nbuf), rope_smem, nope_ptr, stride_nope, rope_ptr, stride_rope, valid, rows,
                    DV, DR, cp_l)
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
    return s0, s1, s2, s3


@gluon.jit
def _tile_ready(raw_smem, k_nope_smem, buf, sc0, sc1, sc2, sc3, IS_FP8: gl.constexpr, cp8_l: gl.constexpr):
    """After this thread's copies of the tile have landed: (fp8_ds_mla) once everyone's raw bytes are in and
    every warp is done with the bf16 tile (P.V of the previous tile), dequantise them (fp8 x group scale in
    fp32, rounded to bf16) into it; then make the tile visible to wgmma (async proxy) and wait for every warp
    (everyone's tile is in; every warp is done with P and with the previous tile's buffers, which take the
    next tile now). Returns the tile's bf16 values."""
    if IS_FP8:
        gl.thread_barrier()
        kn = k_nope_smem.index(0)
        _dequant_group(raw_smem, kn, sc0, 0, cp8_l)
        _dequant_group(raw_smem, kn, sc1, 1, cp8_l)
        _dequant_group(raw_smem, kn, sc2, 2, cp8_l)
        _dequant_group(raw_smem, kn, sc3, 3, cp8_l)
    else:
        kn = k_nope_smem.index(buf)
    fence_async_shared()
    gl.thread_barrier()
    return kn


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
def _token_group(h_q, BH: gl.constexpr):
    """This program's token, head group (of ``BH`` heads) and split: ``(t, t64, hg, sid)``."""
    pid = gl.program_id(0)
    n_hg = gl.cdiv(h_q, BH)
    t = pid // n_hg
    return t, t.to(gl.int64), pid % n_hg, gl.program_id(1)


@gluon.jit
def _alloc_tiles(BH: gl.constexpr, BN: gl.constexpr, DV: gl.constexpr, DR: gl.constexpr, IS_FP8: gl.constexpr):
    """Shared memory for q, the gathered rows (two bf16 buffers; fp8_ds_mla: one bf16 tile dequantised from
    one raw buffer) and their rope parts (two buffers): ``(q_nope, q_rope, k_nope, k_rope, raw)``."""
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    KN_BUFS: gl.constexpr = 1 if IS_FP8 else 2
    q_nope_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DV], sh)
    q_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, DR], sh)
    k_nope_smem = gl.allocate_shared_memory(gl.bfloat16, [KN_BUFS, BN, DV], sh)
    k_rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, DR], sh)
    if IS_FP8:
        raw_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, DV], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    else:
        raw_smem = k_nope_smem  # not used
    return q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, raw_smem


@gluon.jit(do_not_specialize=["T", "h_q", "S", "topk", "split_len"])
def _sparse_mla_sm90_kernel(
    q_ptr, stride_qt, stride_qh,
    nope_ptr, stride_nope,  # [S, 512] bf16 (bf16 cache) or float8_e4m3fn (fp8_ds_mla values)
    scale_ptr, stride_scale,  # [S, 4] f32 group scales (fp8_ds_mla only)
    rope_ptr, stride_rope,  # [S, 64] bf16
    idx_ptr, stride_it,  # [T, topk] int32
    len_ptr, sink_ptr,
    out_ptr, stride_ot, stride_oh, stride_os,  # bf16 [T, h_q, 512] or, with SPLIT, f32 partials [NS, T, h_q, 512]
    ml_ptr, lse_ptr,
    T, h_q, S, topk, split_len,
    sm_scale_log2,
    IS_FP8: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
):
    BH: gl.constexpr = 64
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte pieces, a row per 8 threads
    cp8_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])  # fp8 values: 16-byte pieces
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    t, t64, hg, sid = _token_group(h_q, BH)
    q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, raw_smem = _alloc_tiles(BH, BN, DV, DR, IS_FP8)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], sh)

    start, stop, n_tiles = _span(len_ptr, t, sid, topk, split_len, BN, HAS_LEN)
    idx_row = idx_ptr + t64 * stride_it

    # first tile's copies, the next tile's indices, then q (plain loads into shared memory) while they fly
    row_idx: gl.constexpr = gl.SliceLayout(1, cp8_l if IS_FP8 else cp_l)  # the index vectors' layout
    valid, rows = _tile_rows(idx_row, start, stop, S, BN, row_idx)
    sc0, sc1, sc2, sc3 = _issue(raw_smem, k_nope_smem, k_rope_smem.index(0), 0, nope_ptr, stride_nope, scale_ptr,
                                stride_scale, rope_ptr, stride_rope, valid, rows, IS_FP8, DV, DR, cp_l, cp8_l)
    valid, rows = _tile_rows(idx_row, start + BN, stop, S, BN, row_idx)
    _load_q(q_nope_smem, q_rope_smem, q_ptr, stride_qt, stride_qh, t64, hg, h_q, BH, DV, DR, cp_l)

    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_2d = gl.zeros([BH, BN], gl.float32, s_layout)  # per-column partial sums: no cross-warp sum per tile
    acc = gl.zeros([BH, DV], gl.float32, o_layout)
    s_zero = gl.zeros([BH, BN], gl.float32, s_layout)

    for i in range(n_tiles):
        buf = i % 2
        n0 = start + i * BN
        cp.wait_group(0)  # this thread's copies of tile i have landed
        kn = _tile_ready(raw_smem, k_nope_smem, buf, sc0, sc1, sc2, sc3, IS_FP8, cp8_l)
        kr = k_rope_smem.index(buf)
        s = warpgroup_mma(q_rope_smem, kr.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q_nope_smem, kn.permute((1, 0)), s, is_async=True)
        # while QK runs: tile i + 1's copies (indices loaded one iteration ago), tile i + 2's indices
        sc0, sc1, sc2, sc3 = _issue(raw_smem, k_nope_smem, k_rope_smem.index(1 - buf), 1 - buf, nope_ptr, stride_nope,
                                    scale_ptr, stride_scale, rope_ptr, stride_rope, valid, rows, IS_FP8, DV, DR, cp_l,
                                    cp8_l)
        valid, rows = _tile_rows(idx_row, n0 + 2 * BN, stop, S, BN, row_idx)
        valid_s, _ = _tile_rows(idx_row, n0, stop, S, BN, gl.SliceLayout(0, s_layout))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        s = gl.where(valid_s[None, :], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: avoid -inf - -inf
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_2d = l_2d * alpha[:, None] + p
        m_i = m_new

        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        acc = warpgroup_mma(p_smem, kn.slice(0, DV, dim=1), acc * alpha_o[:, None], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    cp.wait_group(0)

    l_i = gl.sum(l_2d, 1)
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_o = gl.convert_layout(l_i, row_l)
    m_o = gl.convert_layout(m_i, row_l)
    offs_h = hg * BH + gl.arange(0, BH, row_l)
    hmask = offs_h < h_q
    offs_d = gl.arange(0, DV, gl.SliceLayout(0, o_layout))
    inv, lse, ml = row_stats(l_o, m_o, sink_ptr, offs_h, hmask, HAS_SINK, SPLIT)
    if SPLIT:  # partial: normalised out, lse and max in log2 units
        o_ptrs = out_ptr + sid.to(gl.int64) * stride_os + t64 * stride_ot + offs_h[:, None] * stride_oh
        ml_off = (sid.to(gl.int64) * T + t64) * h_q + offs_h
        gl.store(o_ptrs + offs_d[None, :], acc * inv[:, None], mask=hmask[:, None])
    else:
        o_ptrs = out_ptr + t64 * stride_ot + offs_h[:, None] * stride_oh
        ml_off = t64 * h_q + offs_h
        gl.store(o_ptrs + offs_d[None, :], (acc * inv[:, None]).to(gl.bfloat16), mask=hmask[:, None])
    gl.store(lse_ptr + ml_off, lse, mask=hmask)
    gl.store(ml_ptr + ml_off, ml, mask=hmask)


@gluon.jit(do_not_specialize=["T", "h_q", "S", "topk", "split_len"])
def _sparse_mla_sm90_rows_kernel(
    q_ptr, stride_qt, stride_qh,
    nope_ptr, stride_nope,
    scale_ptr, stride_scale,
    rope_ptr, stride_rope,
    idx_ptr, stride_it,
    len_ptr, sink_ptr,
    out_ptr, stride_ot, stride_oh, stride_os,
    ml_ptr, lse_ptr,
    T, h_q, S, topk, split_len,
    sm_scale_log2,
    BH: gl.constexpr, IS_FP8: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
):
    """Small head groups (``BH`` = 16 or 32 heads), one warpgroup: the gathered rows are the M dimension of
    both products and the heads their N (S^T = K q^T, O^T = V^T P^T), so no MMA work is spent on padding
    heads. Same arguments, tiles, copies and epilogue as :func:`_sparse_mla_sm90_kernel`."""
    BN: gl.constexpr = 64
    DV: gl.constexpr = 512
    DR: gl.constexpr = 64

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, 16])
    cp_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    cp8_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    p_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BH], gl.bfloat16)

    t, t64, hg, sid = _token_group(h_q, BH)
    q_nope_smem, q_rope_smem, k_nope_smem, k_rope_smem, raw_smem = _alloc_tiles(BH, BN, DV, DR, IS_FP8)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BH], p_sh)  # P^T

    start, stop, n_tiles = _span(len_ptr, t, sid, topk, split_len, BN, HAS_LEN)
    idx_row = idx_ptr + t64 * stride_it

    row_idx: gl.constexpr = gl.SliceLayout(1, cp8_l if IS_FP8 else cp_l)  # the index vectors' layout
    valid, rows = _tile_rows(idx_row, start, stop, S, BN, row_idx)
    sc0, sc1, sc2, sc3 = _issue(raw_smem, k_nope_smem, k_rope_smem.index(0), 0, nope_ptr, stride_nope, scale_ptr,
                                stride_scale, rope_ptr, stride_rope, valid, rows, IS_FP8, DV, DR, cp_l, cp8_l)
    valid, rows = _tile_rows(idx_row, start + BN, stop, S, BN, row_idx)
    _load_q(q_nope_smem, q_rope_smem, q_ptr, stride_qt, stride_qh, t64, hg, h_q, BH, DV, DR, cp_l)

    head_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_i = gl.full([BH], float("-inf"), gl.float32, head_s)
    l_2d = gl.zeros([BN, BH], gl.float32, s_layout)  # per-row partial sums, reduced over the rows at the end
    acc = gl.zeros([DV, BH], gl.float32, o_layout)  # O^T
    s_zero = gl.zeros([BN, BH], gl.float32, s_layout)

    for i in range(n_tiles):
        buf = i % 2
        n0 = start + i * BN
        cp.wait_group(0)  # this thread's copies of tile i have landed
        kn = _tile_ready(raw_smem, k_nope_smem, buf, sc0, sc1, sc2, sc3, IS_FP8, cp8_l)
        kr = k_rope_smem.index(buf)
        s = warpgroup_mma(kr, q_rope_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(kn, q_nope_smem.permute((1, 0)), s, is_async=True)
        # while QK runs: tile i + 1's copies (indices loaded one iteration ago), tile i + 2's indices
        sc0, sc1, sc2, sc3 = _issue(raw_smem, k_nope_smem, k_rope_smem.index(1 - buf), 1 - buf, nope_ptr, stride_nope,
                                    scale_ptr, stride_scale, rope_ptr, stride_rope, valid, rows, IS_FP8, DV, DR, cp_l,
                                    cp8_l)
        valid, rows = _tile_rows(idx_row, n0 + 2 * BN, stop, S, BN, row_idx)
        valid_s, _ = _tile_rows(idx_row, n0, stop, S, BN, gl.SliceLayout(1, s_layout))
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

        s = gl.where(valid_s[:, None], s * sm_scale_log2, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_2d = l_2d * alpha[None, :] + p
        m_i = m_new

        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))
        acc = warpgroup_mma(kn.permute((1, 0)), p_smem, acc * alpha_o[None, :], is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    cp.wait_group(0)

    l_i = gl.sum(l_2d, 0)
    head_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    l_o = gl.convert_layout(l_i, head_o)
    m_o = gl.convert_layout(m_i, head_o)
    offs_h = hg * BH + gl.arange(0, BH, head_o)
    hmask = offs_h < h_q
    offs_d = gl.arange(0, DV, gl.SliceLayout(1, o_layout))
    inv, lse, ml = row_stats(l_o, m_o, sink_ptr, offs_h, hmask, HAS_SINK, SPLIT)
    if SPLIT:
        o_ptrs = out_ptr + sid.to(gl.int64) * stride_os + t64 * stride_ot + offs_h[None, :] * stride_oh
        ml_off = (sid.to(gl.int64) * T + t64) * h_q + offs_h
        gl.store(o_ptrs + offs_d[:, None], acc * inv[None, :], mask=hmask[None, :])
    else:
        o_ptrs = out_ptr + t64 * stride_ot + offs_h[None, :] * stride_oh
        ml_off = t64 * h_q + offs_h
        gl.store(o_ptrs + offs_d[:, None], (acc * inv[None, :]).to(gl.bfloat16), mask=hmask[None, :])
    gl.store(lse_ptr + ml_off, lse, mask=hmask)
    gl.store(ml_ptr + ml_off, ml, mask=hmask)


def supported(q: torch.Tensor, kv: torch.Tensor, block_h: int) -> bool:
    """Whether these kernels serve the call: head groups of 64 (:func:`_sparse_mla_sm90_kernel`) or of 16
    or 32 (:func:`_sparse_mla_sm90_rows_kernel`) on an NVIDIA Hopper GPU (:func:`dsa.backend.on_hopper`:
    not ROCm, not under the Triton interpreter), either cache format (``kv`` the flat ``[S, 576]`` bf16 or ``[S, 656]`` uint8 view)
    starting on a 16-byte boundary (its rows are copied in 16-byte pieces; a cache that does not is
    served by the Triton kernel)."""
    from ..backend import on_hopper

    return block_h in (16, 32, BLOCK_H) and kv.data_ptr() % 16 == 0 and on_hopper(q.device)


def launch(grid, q, nope, scales, stride_scale, rope, indices, len_arg, sink_arg, out, stride_ot, stride_oh,
           stride_os, ml, lse, T, h_q, S, topk, split_len, scale_log2, has_len, has_sink, split, block_h=BLOCK_H):
    """Launch on validated, prepared arguments (called by :func:`dsa.mla.kernel.sparse_mla_triton` when
    :func:`supported`): the 64-head kernel, or the small-head one for ``block_h`` 16 / 32."""
    # what the copies assume: every row's values and rope part start on a 16-byte boundary
    assert nope.stride(0) * nope.element_size() % 16 == 0 and rope.stride(0) * rope.element_size() % 16 == 0
    assert nope.data_ptr() % 16 == 0 and rope.data_ptr() % 16 == 0
    args = (q, q.stride(0), q.stride(1), nope, nope.stride(0), scales, stride_scale, rope, rope.stride(0), indices,
            indices.stride(0), len_arg, sink_arg, out, stride_ot, stride_oh, stride_os, ml, lse, T, h_q, S, topk,
            split_len, scale_log2)
    flags = dict(IS_FP8=nope.dtype != torch.bfloat16, HAS_LEN=has_len, HAS_SINK=has_sink, SPLIT=split)
    if block_h == BLOCK_H:
        _sparse_mla_sm90_kernel[grid](*args, **flags, num_warps=NUM_WARPS)
    else:
        _sparse_mla_sm90_rows_kernel[grid](*args, BH=block_h, **flags, num_warps=4)
