"""Sparse MLA decode with 16 heads (or fewer) over the fp8_ds_mla cache on Hopper (sm_90), fed by a ring of bulk
copies (Gluon).

Why a third kernel: for 16 heads over the fp8 cache the time goes to getting the rows in and turning them into
operands, not to the products. :mod:`dsa.mla.kernel_sm90` dequantises each tile into a bf16 buffer that its
wgmma products read; this kernel never writes one. One program = one split of one query token's index list
(16 heads), one CTA per SM (186 KiB of shared memory: the ring 164 KiB, the logits' two buffers 20 KiB):

* Two loader partitions of 2 warps (:func:`_loader`) take alternate 64-row tiles and copy each 656-byte row
  whole with one ``cp.async.bulk`` into a ring of 4 stages; an invalid entry copies a zero row. The ring is
  the kernel's dynamic shared memory (``global_smem``) at the offsets of the compiler's own allocation
  (:func:`resolve_offsets` reads them from the allocation pass, compiles again with them as constants and
  checks that they did not move): Gluon has no view of a 656-byte pitch.
* Four math warps (:func:`_math`), warp ``g`` owning value group ``g`` (128 values and their scale; 16 of the
  64 rope values). Every operand is read 16 bytes per lane from the ring and converted in registers
  (``cvt.rn.f16x2.e4m3x2``, exact) for ``mma.sync``: QK in f16 with q scaled per group by a power of two
  into f16's range and the row scale applied to the group's logits afterwards (exact for power-of-two scales),
  the rope part in bf16; the four groups' partial logits summed through swizzled shared buffers (each warp sums a
  quarter of the rows, and every warp reads all the sums back: two CTA barriers); P.V with two rows' bytes paired
  per register (``prmt``), P times the row's group scale over the tile's largest such scale in f16. Each thread
  releases the stage with its own mbarrier arrival.
* The tile's index entries are loaded a tile ahead, two per lane, and their validity reaches the softmax's
  layout as the 64 bits of two warp ballots (:func:`_valid_bits`).
* The kernel finishes the call itself: at one split it writes the bf16 output, lse and max_logits; at more,
  each program stores its fp32 partials and counts itself done on its token's counter (zeroed by the call, so
  calls on concurrent streams or in CUDA graphs never share one), and the last one merges them (:func:`_finish`).

Fewer than 16 heads (h_q 8: TP16 of a 128-head model) run the same 16-head products with the missing heads' q zero
(``NH``, a constexpr: at 16 the sm_90a code holds the same instructions as before it existed, some in another
order); only the first ``NH`` heads are stored, and the last program's merge loads only theirs. The split partials
keep 16 heads.

Where it serves (:func:`applies`, :func:`serves`; BENCHMARKS.md, twenty-eighth session): 1-16 heads, the fp8_ds_mla
cache, sm_90, from batch 32, where it measured faster than :mod:`dsa.mla.kernel_sm90` (H200, topk 2048 of 32K, CUDA
graphs: 10-29% less time at batch 32-256; batch 128 53.5-58.1 us in the runs of the twenty-eighth to thirtieth
sessions, against the goal's 57.1). The fp32 products differ from the other kernels only in the order of their sums
(fp8 values and power-of-two scales convert exactly; P goes to the products in f16 instead of bf16).
"""
from __future__ import annotations

import os
import re
import tempfile

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .. import _replay
from ..backend import num_sms
from ..constants import D_QK, D_V, FP8_DS_MLA_ROPE_OFFSET, FP8_DS_MLA_ROW_BYTES, FP8_DS_MLA_SCALE_OFFSET
from .epilogue import merge_weights, outputs, row_stats

BN = gl.constexpr(64)  # rows per tile
H = gl.constexpr(16)  # heads
ROW = gl.constexpr(FP8_DS_MLA_ROW_BYTES)  # 656
SCALES = gl.constexpr(FP8_DS_MLA_SCALE_OFFSET)  # 512
ROPE = gl.constexpr(FP8_DS_MLA_ROPE_OFFSET)  # 528
LN2 = gl.constexpr(0.6931471805599453)
#: the ring's stages (64 rows each) and the warps of each of the two loader partitions
STAGES = 4
LOADER_WARPS = 2
#: the most query tokens per call (the grid's second axis)
_MAX_T = 65535

_LD4 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $4;"
                    " ld.shared.v4.u32 {$0, $1, $2, $3}, [a]; }")
_LD2 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $2; ld.shared.v2.u32 {$0, $1}, [a]; }")
_LD1 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.f32 $0, [a]; }")
_CVT2 = gl.constexpr("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l;"
                     " cvt.rn.f16x2.e4m3x2 $1, h; }")
# two rows' words a (row r) and b (row r + 1): four f16x2 words, (a.byte c, b.byte c) for c = 0..3
_PAIR4 = gl.constexpr("{ .reg .b32 x, y; .reg .b16 l, h; prmt.b32 x, $4, $5, 0x5140; prmt.b32 y, $4, $5, 0x7362;"
                      " mov.b32 {l, h}, x; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h;"
                      " mov.b32 {l, h}, y; cvt.rn.f16x2.e4m3x2 $2, l; cvt.rn.f16x2.e4m3x2 $3, h; }")


# ------------------------------------------------------------------------------------------------------
# operands from the ring's raw bytes
# ------------------------------------------------------------------------------------------------------
@gluon.jit
def _halves(w):
    """An int32 tensor as its two 16-bit halves (low first) along a new last dimension, as f16."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(w, w)], dtype=gl.float16, is_pure=True,
                                     pack=2)


@gluon.jit
def _halves_bf16(w):
    """:func:`_halves` as bf16."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(w, w)], dtype=gl.bfloat16, is_pure=True,
                                     pack=2)


@gluon.jit
def _j4(a, b, c, d):
    """join of four: ``[..., i0, i1]`` with element i0 + 2 i1."""
    return gl.join(gl.join(a, b), gl.join(c, d))


@gluon.jit
def _ld4(addr):
    """16 bytes of shared memory at each element's offset into ``global_smem``, as four int32."""
    return gl.inline_asm_elementwise(_LD4, "=r,=r,=r,=r,r", [addr], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                     is_pure=False, pack=1)


@gluon.jit
def _cvt16(off):
    """16 fp8 bytes per element of ``off`` (shared offsets), as f16 along four new last dimensions
    ``[..., e0, m0, m1, m2]``: byte ``2 m + e0`` with m = m0 + 2 m1 + 4 m2 (``cvt.rn.f16x2.e4m3x2``, exact)."""
    w0, w1, w2, w3 = _ld4(off)
    c0, c1 = gl.inline_asm_elementwise(_CVT2, "=r,=r,r", [w0], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    c2, c3 = gl.inline_asm_elementwise(_CVT2, "=r,=r,r", [w1], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    c4, c5 = gl.inline_asm_elementwise(_CVT2, "=r,=r,r", [w2], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    c6, c7 = gl.inline_asm_elementwise(_CVT2, "=r,=r,r", [w3], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
    lo = _j4(_halves(c0), _halves(c1), _halves(c2), _halves(c3))
    hi = _j4(_halves(c4), _halves(c5), _halves(c6), _halves(c7))
    return gl.join(lo, hi)


@gluon.jit
def _qk_operand(off):
    """The QK B operand ``[4 g, 128 k, 64 n]`` f16 from ``off`` [4 g, 8 nb, 8 j, 4 t, 2 h] (shared offsets of row
    ``8 nb + j``, bytes ``128 g + 32 t + 16 h``); logical k = 64 h + 16 (m >> 1) + 8 (m & 1) + 2 t + e0 for byte
    ``2 m + e0`` of the load."""
    f = _cvt16(off)  # [4 g, 8 nb, 8 j, 4 t, 2 h, 2 e0, 2 m0, 2 m1, 2 m2]
    f = gl.permute(f, [0, 4, 8, 7, 6, 3, 5, 1, 2])  # [g, h, m2, m1, m0, t, e0, nb, j]
    return gl.reshape(f, [4, 128, BN])


@gluon.jit
def _rope_operand(off):
    """The rope QK B operand ``[4 g, 16 k, 64 n]`` bf16 from ``off`` [4 g, 8 nb, 8 j, 4 t] (row ``8 nb + j``,
    bytes ``528 + 32 g + 8 t``); logical k = 8 r + 2 t + e0 for rope value ``2 r + e0`` of the load."""
    r0, r1 = gl.inline_asm_elementwise(_LD2, "=r,=r,r", [off], dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
    f = gl.join(_halves_bf16(r0), _halves_bf16(r1))  # [g, nb, j, t, e0, r]
    f = gl.permute(f, [0, 5, 3, 4, 1, 2])  # [g, r, t, e0, nb, j]
    return gl.reshape(f, [4, 16, BN])


@gluon.jit
def _pv_offsets():
    """Shared offsets within a tile for :func:`_pv_operand`: [4 g, 4 kk, 2 rb, 8 j, 4 t, 2 e0], row
    ``16 kk + 8 rb + 2 t + e0``, bytes ``128 g + 16 j``."""
    LV: gl.constexpr = gl.BlockedLayout([1, 4, 2, 1, 1, 2], [1, 1, 1, 8, 4, 1], [4, 1, 1, 1, 1, 1],
                                        [5, 2, 1, 4, 3, 0])
    v0 = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v1 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v2 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v3 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v4 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
        5, LV))))))
    v5 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
        4, LV))))))
    vrow = (16 * v1[None, :, None, None, None, None] + 8 * v2[None, None, :, None, None, None]
            + 2 * v4[None, None, None, None, :, None] + v5[None, None, None, None, None, :])
    return vrow * ROW + 128 * v0[:, None, None, None, None, None] + 16 * v3[None, None, None, :, None, None]


@gluon.jit
def _pv_operand(off):
    """The P.V B operand ``[4 g, 64 k, 128 n]`` f16 from ``off`` [4 g, 4 kk, 2 rb, 8 j, 4 t, 2 e0] (row
    ``16 kk + 8 rb + 2 t + e0``, bytes ``128 g + 16 j``); logical n = j + 8 c for byte c of the load."""
    w0, w1, w2, w3 = _ld4(off)
    a0, b0 = gl.split(w0)
    a1, b1 = gl.split(w1)
    a2, b2 = gl.split(w2)
    a3, b3 = gl.split(w3)
    u0, u1, u2, u3 = gl.inline_asm_elementwise(_PAIR4, "=r,=r,=r,=r,r,r", [a0, b0], dtype=(gl.int32, ) * 4,
                                               is_pure=True, pack=1)
    u4, u5, u6, u7 = gl.inline_asm_elementwise(_PAIR4, "=r,=r,=r,=r,r,r", [a1, b1], dtype=(gl.int32, ) * 4,
                                               is_pure=True, pack=1)
    u8, u9, u10, u11 = gl.inline_asm_elementwise(_PAIR4, "=r,=r,=r,=r,r,r", [a2, b2], dtype=(gl.int32, ) * 4,
                                                 is_pure=True, pack=1)
    u12, u13, u14, u15 = gl.inline_asm_elementwise(_PAIR4, "=r,=r,=r,=r,r,r", [a3, b3], dtype=(gl.int32, ) * 4,
                                                   is_pure=True, pack=1)
    f0 = _j4(_halves(u0), _halves(u1), _halves(u2), _halves(u3))
    f1 = _j4(_halves(u4), _halves(u5), _halves(u6), _halves(u7))
    f2 = _j4(_halves(u8), _halves(u9), _halves(u10), _halves(u11))
    f3 = _j4(_halves(u12), _halves(u13), _halves(u14), _halves(u15))
    f = _j4(f0, f1, f2, f3)  # [4 g, 4 kk, 2 rb, 8 j, 4 t, 2 e0, 2 c0, 2 c1, 2 c2, 2 c3]
    f = gl.permute(f, [0, 1, 2, 4, 5, 9, 8, 7, 6, 3])  # [g, kk, rb, t, e0, c3, c2, c1, c0, j]
    return gl.reshape(f, [4, BN, 128])


@gluon.jit
def _load_q(q_ptr, stride_qt, stride_qh, t64, NH: gl.constexpr, a_l: gl.constexpr):
    """q's values ``[4 g, 16, 128]`` f32 in ``a_l``, in the permuted k order of :func:`_qk_operand` (heads from
    ``NH`` on zero), and each group's power of two ``qe`` [4] that puts them in f16's range (largest in [2^14,
    2^15))."""
    g = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    h = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    k = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    pk = 32 * ((k >> 1) & 3) + 16 * (k >> 6) + 4 * ((k >> 4) & 3) + 2 * ((k >> 3) & 1) + (k & 1)
    qv = gl.load(q_ptr + t64 * stride_qt + h[None, :, None] * stride_qh + g[:, None, None] * 128
                 + pk[None, None, :], mask=(h < NH)[None, :, None], other=0.0).to(gl.float32)
    qmax = gl.max(gl.max(gl.abs(qv), axis=2), axis=1)
    return qv, gl.where(qmax > 0, 14.0 - gl.floor(gl.log2(gl.where(qmax > 0, qmax, 1.0))), 0.0)


@gluon.jit
def _store_rows(o, row_ptr, stride_h, nh: gl.constexpr, OL: gl.constexpr):
    """P.V's normalised ``o`` [4 g, 16, 128] (logical column n holds value 16 (n % 8) + n // 8 of group ``g``)
    into the first ``nh`` of the 16 head rows of 512 values at ``row_ptr`` (head stride ``stride_h``), in
    ``row_ptr``'s type: put back in order (``OL``), 16-byte stores (f32)."""
    o = gl.reshape(gl.permute(gl.reshape(o, [4, H, 16, 8]), [0, 1, 3, 2]), [4, H, 128])
    o = gl.convert_layout(o, OL)
    go = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, OL)))
    ho = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, OL)))
    co = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, OL)))
    gl.store(row_ptr + ho[None, :, None].to(gl.int64) * stride_h + go[:, None, None] * 128 + co[None, None, :],
             o.to(row_ptr.dtype.element_ty), mask=(ho < nh)[None, :, None])


# ------------------------------------------------------------------------------------------------------
# the ring
# ------------------------------------------------------------------------------------------------------
@gluon.jit
def stage_barriers(NSTAGES: gl.constexpr, EMPTY_COUNT: gl.constexpr = 1):
    """A ring's ``full`` and ``empty`` mbarriers, ``[NSTAGES, 1]`` each, initialised to one arrival (``empty``:
    ``EMPTY_COUNT``)."""
    full = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NSTAGES):
        mbarrier.init(full.index(j), count=1)
        mbarrier.init(empty.index(j), count=EMPTY_COUNT)
    return full, empty


@gluon.jit
def _clock(NW: gl.constexpr):
    """Each of the ``NW`` warps' threads' SM clock (``%clock``), one per thread (``TRACE``)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [gl.full([32 * NW], 0, gl.int32, lay)],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release(s, EMPTY_OFF: gl.constexpr):
    """Release stage ``s``: every thread of the 4 math warps arrives on its ``empty`` barrier itself (inline PTX at
    the barrier's shared offset; the barrier counts 128 arrivals), after its own last read of the stage."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    gl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .b64 st; mov.u32 a, global_smem; add.u32 a, a, $1;"
        " mbarrier.arrive.shared::cta.b64 st, [a]; mov.u32 $0, 0; }", "=r,r",
        [gl.full([128], EMPTY_OFF, gl.int32, lay) + s * 8], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, NSTAGES: gl.constexpr,
            RING_OFF: gl.constexpr, BAR_OFF: gl.constexpr, W: gl.constexpr, LWW: gl.constexpr, ltr_ptr, pid,
            TRACE: gl.constexpr):
    """Tiles ``W, W + 2, ...``, each row one bulk copy of 656 bytes (a zero row for an invalid entry); the
    partition's ``LWW`` warps split a tile's rows. ``TRACE``: each thread's clock sums (the wait for a free stage,
    the copies' issue) go to ``ltr_ptr`` ``[program pid, loader W, 2, 32 LWW]``."""
    lay: gl.constexpr = gl.BlockedLayout([BN // (32 * LWW)], [32], [LWW], [0])
    r = gl.arange(0, BN, lay)
    n = start + W * BN + r
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)
    if TRACE:
        tl_: gl.constexpr = gl.BlockedLayout([1], [32], [LWW], [0])
        tw = gl.zeros([32 * LWW], gl.int32, tl_)
        ti = gl.zeros([32 * LWW], gl.int32, tl_)
    for i in range(W, n_tiles, 2):
        s = i % NSTAGES
        ok = (idx >= 0) & (idx < S)
        src = gl.where(ok, kv_ptr + gl.where(ok, idx, 0).to(gl.int64) * ROW, zero_ptr)
        n = start + (i + 2) * BN + r  # this loader's next tile's entries, loaded while this one waits for its stage
        idx = gl.load(idx_row + n, mask=n < stop, other=-1)
        if TRACE:
            c0 = _clock(LWW)
        if i >= NSTAGES:
            mbarrier.wait(empty.index(s), ((i // NSTAGES) & 1) ^ 1)
        if TRACE:
            c1 = _clock(LWW)
        bar = gl.full([BN], BAR_OFF, gl.int32, lay) + s * 8
        mbarrier.expect(full.index(s), BN * ROW)
        gl.inline_asm_elementwise(
            "{ .reg .u32 a, b; mov.u32 a, global_smem; add.u32 b, a, $3; add.u32 a, a, $1;\n"
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [a], [$2], 656, [b];\n"
            "mov.u32 $0, 0; }", "=r,r,l,r", [RING_OFF + (s * BN + r) * ROW, src, bar], dtype=gl.int32,
            is_pure=False, pack=1)
        if TRACE:
            c2 = _clock(LWW)
            tw += c1 - c0
            ti += c2 - c1
    if TRACE:
        th = gl.arange(0, 32 * LWW, tl_)
        row = ltr_ptr + ((pid * 2 + W) * 2) * (32 * LWW) + th
        gl.store(row, tw)
        gl.store(row + 32 * LWW, ti)


# ------------------------------------------------------------------------------------------------------
# the math warps
# ------------------------------------------------------------------------------------------------------
@gluon.jit
def _valid_bits(valid, rows, prow):
    """``valid`` [64] (two rows per lane, the same in every warp; ``rows`` their positions) as the 64 bits of a
    warp's two ballots, read back at positions ``prow`` (any layout)."""
    m = gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.s32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff; }",
                                  "=r,r", [gl.where(valid, 1, 0)], dtype=gl.int32, is_pure=False, pack=1)
    lo = gl.max(gl.where(rows < 32, m, -2147483648), axis=0).to(gl.uint32, bitcast=True).to(gl.int64)
    hi = gl.max(gl.where(rows >= 32, m, -2147483648), axis=0).to(gl.uint32, bitcast=True).to(gl.int64)
    return ((((hi << 32) | lo) >> prow.to(gl.int64)) & 1) != 0


@gluon.jit
def _sum_logits(red, rsum, sp, valid, RED_L: gl.constexpr, p_l: gl.constexpr):
    """The four groups' partial logits summed through shared memory, invalid rows -inf: the products store their
    partials into ``red`` [4 groups, 16 heads, 64 rows], each warp sums a quarter of the rows (``RED_L``) into
    ``rsum`` [1, 16, 64], and every warp reads all the sums back (``p_l``); two barriers."""
    red.store(sp)  # (the compiler puts a CTA barrier before each read of what another warp stored)
    rsum.store(gl.sum(red.load(RED_L), axis=0, keep_dims=True))
    lg = rsum.load(p_l)
    return gl.where(gl.expand_dims(valid, 1), lg, float("-inf"))


@gluon.jit
def _pv_step(lg, sc, base, off_pv, acc, m_i, l_i, ms_prev, sm_scale_log2, mma: gl.constexpr, a_l: gl.constexpr,
             b_l: gl.constexpr, L4: gl.constexpr):
    """One tile's online softmax and P.V; returns the new (acc, m, l, largest scales)."""
    m_new = gl.maximum(m_i, gl.max(lg, axis=2) * sm_scale_log2)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(lg * sm_scale_log2 - gl.expand_dims(m_use, 2))
    l_i = l_i * alpha + gl.sum(p, axis=2)
    ms = gl.max(sc, axis=1)
    ms = gl.where(ms > 0, ms, 1.0)
    ratio = gl.convert_layout(gl.reshape(sc / ms[:, None], [1, 4, BN]), gl.SliceLayout(2, L4))
    pw = gl.convert_layout(gl.reshape(gl.expand_dims(p, 1) * gl.expand_dims(ratio, 2), [4, H, BN]), mma)
    al = gl.convert_layout(alpha, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    mr = gl.convert_layout(gl.reshape(ms_prev / ms, [1, 4]), gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    a3 = gl.convert_layout(gl.reshape(gl.expand_dims(al, 1) * gl.expand_dims(mr, 2), [4, H]), gl.SliceLayout(2, mma))
    vt = gl.convert_layout(_pv_operand(off_pv + base), b_l)
    acc = mma_v2(gl.convert_layout(pw.to(gl.float16), a_l), vt, acc * gl.expand_dims(a3, 2))
    return acc, m_new, l_i, ms


@gluon.jit
def _tile(i, red, rsum, idx, idx_row, start, stop, rows, prow, S, full, off_sc, off_qk, off_rope, off_pv, q16, qr,
          qinv, zs, acc, m_i, l_i, ms_prev, sm_scale_log2, tr, mma: gl.constexpr, a_l: gl.constexpr, b_l: gl.constexpr,
          p_l: gl.constexpr, L4: gl.constexpr, RED_L: gl.constexpr, NSTAGES: gl.constexpr,
          RING_OFF: gl.constexpr, EMPTY_OFF: gl.constexpr, TRACE: gl.constexpr):
    """Tile ``i`` (``idx``: its index entries, two per lane at ``rows``; returns the next tile's). ``TRACE``: ``tr``
    (per-thread clock sums: the wait for the stage, QK and the logits' sum up to its barrier, the softmax and P.V
    up to the release, the rest up to the next tile; and the last clock read) gains this tile's."""
    if TRACE:
        t0 = _clock(4)
    s = i % NSTAGES
    valid = _valid_bits((idx >= 0) & (idx < S), rows, prow)
    n = start + (i + 1) * BN + rows
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)  # the next tile's entries, a tile ahead of their use
    mbarrier.wait(full.index(s), (i // NSTAGES) & 1)
    base = RING_OFF + s * (BN * ROW)
    if TRACE:
        t1 = _clock(4)
    sc = gl.inline_asm_elementwise(_LD1, "=r,r", [off_sc + base], dtype=gl.float32, is_pure=False, pack=1)
    kq = gl.convert_layout(_qk_operand(off_qk + base), b_l)
    sp = mma_v2(q16, kq, zs)
    sp = sp * gl.expand_dims(sc * qinv[:, None], 1)
    sp = mma_v2(qr, gl.convert_layout(_rope_operand(off_rope + base), b_l), sp)
    lg = _sum_logits(red, rsum, sp, valid, RED_L, p_l)
    if TRACE:
        t2 = _clock(4)
    acc, m_i, l_i, ms_prev = _pv_step(lg, sc, base, off_pv, acc, m_i, l_i, ms_prev, sm_scale_log2, mma, a_l, b_l, L4)
    _release(s, EMPTY_OFF)
    if TRACE:
        t3 = _clock(4)
        w, q, p, g, last = tr
        tr = (w + (t1 - t0), q + (t2 - t1), p + (t3 - t2), g + gl.where(i > 0, t0 - last, 0), t3)
    return acc, m_i, l_i, ms_prev, idx, tr


@gluon.jit
def _math(red, rsum, full, empty, q_ptr, stride_qt, stride_qh, idx_row, o_ptr, lse_ptr, ml_ptr, t64, sid, T, start,
          stop, n_tiles, S, NH: gl.constexpr, sm_scale_log2, out_ptr, stride_ot, stride_oh, fl_ptr, fm_ptr, cnt_ptr,
          sink_ptr, trace_ptr,
          NSTAGES: gl.constexpr, RING_OFF: gl.constexpr, EMPTY_OFF: gl.constexpr, SKIP: gl.constexpr,
          RED_L: gl.constexpr, L4: gl.constexpr, OUT_L: gl.constexpr, IDX_L: gl.constexpr,
          NSPLIT: gl.constexpr, HAS_SINK: gl.constexpr, TRACE: gl.constexpr):
    """The 4 math warps (the default partition): warp ``g`` owns value group ``g``; per tile QK, the logits' sum,
    the online softmax, P.V, the stage's release; then the output (one split) or the partials and the merge by the
    last program (:func:`_finish`). ``SKIP``: the copies alone (each stage released unread; benchmarks)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    c_l: gl.constexpr = gl.SliceLayout(1, mma)  # [4, 64]: the rows' group scales
    p_l: gl.constexpr = gl.SliceLayout(1, L4)  # [1, 16, 64]: the tile's logits
    r_l: gl.constexpr = gl.SliceLayout(2, p_l)  # [1, 16]: the softmax state
    # ---- q in the permuted k order, f16 scaled per group by a power of two; rope bf16 ----
    qv, qe = _load_q(q_ptr, stride_qt, stride_qh, t64, NH, a_l)
    q16 = (qv * gl.exp2(qe)[:, None, None]).to(gl.float16)
    bq = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    h = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    kr = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    pr = 4 * ((kr >> 1) & 3) + 2 * (kr >> 3) + (kr & 1)
    qr = gl.load(q_ptr + t64 * stride_qt + h[None, :, None] * stride_qh + 512 + bq[:, None, None] * 16
                 + pr[None, None, :], mask=(h < NH)[None, :, None], other=0.0)
    # ---- per-thread shared offsets within a tile (the tile's base added per tile) ----
    LQ: gl.constexpr = gl.BlockedLayout([1, 8, 1, 1, 2], [1, 1, 8, 4, 1], [4, 1, 1, 1, 1], [4, 1, 3, 2, 0])
    x0 = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    x1 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    x2 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    x3 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, LQ)))))
    x4 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LQ)))))
    off_qk = ((8 * x1[None, :, None, None, None] + x2[None, None, :, None, None]) * ROW
              + 128 * x0[:, None, None, None, None] + 32 * x3[None, None, None, :, None]
              + 16 * x4[None, None, None, None, :])
    LR: gl.constexpr = gl.BlockedLayout([1, 8, 1, 1], [1, 1, 8, 4], [4, 1, 1, 1], [1, 3, 2, 0])
    r0 = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LR))))
    r1 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LR))))
    r2 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LR))))
    r3 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LR))))
    off_rope = ((8 * r1[None, :, None, None] + r2[None, None, :, None]) * ROW
                + ROPE + 32 * r0[:, None, None, None] + 8 * r3[None, None, None, :])
    off_pv = _pv_offsets()
    sb = gl.arange(0, 4, gl.SliceLayout(1, c_l))
    sn = gl.arange(0, BN, gl.SliceLayout(0, c_l))
    off_sc = sn[None, :] * ROW + SCALES + 4 * sb[:, None]
    # the tile's rows as the softmax sees them, and its index entries two per lane
    vh = gl.arange(0, 1, gl.SliceLayout(1, gl.SliceLayout(1, p_l)))
    vn = gl.arange(0, BN, gl.SliceLayout(0, gl.SliceLayout(1, p_l)))
    prow = vh[:, None] + vn[None, :]  # [1, 64]
    rows = gl.arange(0, BN, IDX_L)
    # ---- the loop ----
    zs = gl.zeros([4, H, BN], gl.float32, mma)
    acc = gl.zeros([4, H, 128], gl.float32, mma)
    m_i = gl.full([1, H], float("-inf"), gl.float32, r_l)
    l_i = gl.zeros([1, H], gl.float32, r_l)
    ms_prev = gl.full([4], 1.0, gl.float32, gl.SliceLayout(1, c_l))
    qinv = gl.convert_layout(gl.exp2(-qe), gl.SliceLayout(1, c_l))
    if SKIP:
        for i in range(n_tiles):
            mbarrier.wait(full.index(i % NSTAGES), (i // NSTAGES) & 1)
            _release(i % NSTAGES, EMPTY_OFF)
        n_tiles = 0
    n = start + rows
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)
    z = gl.zeros([128], gl.int32, gl.BlockedLayout([1], [32], [4], [0]))
    tr = (z, z, z, z, z)
    for i in range(n_tiles):
        acc, m_i, l_i, ms_prev, idx, tr = _tile(i, red, rsum, idx, idx_row, start, stop, rows, prow, S, full, off_sc,
                                                off_qk, off_rope, off_pv, q16, qr, qinv, zs, acc, m_i, l_i, ms_prev,
                                                sm_scale_log2, tr, mma, a_l, b_l, p_l, L4, RED_L, NSTAGES,
                                                RING_OFF, EMPTY_OFF, TRACE)
    if TRACE:  # [program, 4 sums, thread]
        th = gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0]))
        row = trace_ptr + (sid * T + t64) * (4 * 128) + th
        for k in gl.static_range(4):
            gl.store(row + k * 128, tr[k])
    hh = gl.arange(0, H, gl.SliceLayout(0, r_l))
    if NSPLIT == 1:  # the final values: natural-log lse (+inf when empty), the sink only in the denominator
        inv, lse, ml = row_stats(l_i, m_i, sink_ptr, hh[None, :], hh[None, :] < NH, HAS_SINK, False)
    else:  # the split partials: lse and max in log2 units, -inf when empty
        inv, lse, ml = row_stats(l_i, m_i, None, None, None, False, True)
    iv = gl.convert_layout(inv, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    mp = gl.convert_layout(gl.reshape(ms_prev, [1, 4]), gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    f3 = gl.convert_layout(gl.reshape(gl.expand_dims(iv, 1) * gl.expand_dims(mp, 2), [4, H]), gl.SliceLayout(2, mma))
    if NSPLIT == 1:
        gl.store(fl_ptr + t64 * NH + hh[None, :], lse, mask=hh[None, :] < NH)
        gl.store(fm_ptr + t64 * NH + hh[None, :], ml, mask=hh[None, :] < NH)
        _store_rows(acc * gl.expand_dims(f3, 2), out_ptr + t64 * stride_ot, stride_oh, NH, OUT_L)
    else:
        slot = sid * T + t64
        gl.store(lse_ptr + slot * H + hh[None, :], lse)
        gl.store(ml_ptr + slot * H + hh[None, :], ml)
        _store_rows(acc * gl.expand_dims(f3, 2), o_ptr + slot * (H * 512), 512, H, OUT_L)
        _finish(o_ptr, lse_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, fl_ptr, fm_ptr, cnt_ptr, T, t64, NH, NSPLIT,
                sink_ptr, HAS_SINK)


@gluon.jit
def _finish(o_ptr, lse_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, fl_ptr, fm_ptr, cnt_ptr, T, t64, NH: gl.constexpr,
            NSPLIT: gl.constexpr, sink_ptr, HAS_SINK: gl.constexpr):
    """The split merge inside the kernel: each program counts itself done on the token's counter (after its
    partials are stored); the last of the ``NSPLIT`` merges them all with :func:`~dsa.mla.epilogue.merge_weights`
    (the arithmetic of ``_sparse_mla_combine_kernel``; the sink only in the denominator) into the final ``out``
    bf16, natural-log lse (+inf for a row with no valid entry) and max_logits. The splits' lse are padded to a power
    of two with ``-inf``; the partials (16 heads each) stream in split by split into one ``[16, 512]`` accumulator,
    whose first ``NH`` heads are stored."""
    gl.thread_barrier()  # every warp's partials are stored before the count
    done = gl.atomic_add(cnt_ptr + t64, 1, sem="acq_rel", scope="gpu")
    if done == NSPLIT - 1:
        NS: gl.constexpr = triton.next_power_of_2(NSPLIT)
        l3: gl.constexpr = gl.BlockedLayout([NS, 1, 4], [1, 1, 32], [1, 4, 1], [2, 1, 0])  # [NS, 16 heads, 512]
        sh_l: gl.constexpr = gl.SliceLayout(2, l3)  # [NS, 16]: every split's lse of a head in one thread
        o_l: gl.constexpr = gl.SliceLayout(0, l3)  # [16, 512]
        ss = gl.arange(0, NS, gl.SliceLayout(1, sh_l))
        hh = gl.arange(0, H, gl.SliceLayout(0, sh_l))
        part = (ss[:, None].to(gl.int64) * T + t64) * H + hh[None, :]
        pmask = (ss < NSPLIT)[:, None] & (hh < H)[None, :]
        w_s, m_use, inv, lse, empty = merge_weights(gl.load(lse_ptr + part, mask=pmask, other=float("-inf")),
                                                    sink_ptr, hh, hh < NH, HAS_SINK)
        ml = gl.max(gl.load(ml_ptr + part, mask=pmask, other=float("-inf")), 0)
        # the partials stream in split by split (every load before the first store: the stores could alias them)
        ho = gl.arange(0, H, gl.SliceLayout(1, o_l))
        cc = gl.arange(0, 512, gl.SliceLayout(0, o_l))
        acc = gl.zeros([H, 512], gl.float32, o_l)
        for sp in gl.static_range(NSPLIT):
            w = gl.convert_layout(gl.sum(gl.where((ss == sp)[:, None], w_s, 0.0), 0), gl.SliceLayout(1, o_l))
            acc += w[:, None] * gl.load(o_ptr + ((sp * T + t64) * H + ho)[:, None] * 512 + cc[None, :])
        inv_o = gl.convert_layout(inv, gl.SliceLayout(1, o_l))
        gl.store(out_ptr + t64 * stride_ot + ho[:, None].to(gl.int64) * stride_oh + cc[None, :],
                 (acc * inv_o[:, None]).to(gl.bfloat16), mask=(ho < NH)[:, None])
        gl.store(fl_ptr + t64 * NH + hh, lse, mask=hh < NH)
        gl.store(fm_ptr + t64 * NH + hh, gl.where(empty, float("-inf"), ml * LN2), mask=hh < NH)


@gluon.jit
def _sparse_mla_bulk_kernel(q_ptr, stride_qt, stride_qh, kv_ptr, zero_ptr, idx_ptr, stride_it, len_ptr, sink_ptr,
                            o_ptr, lse_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, fl_ptr, fm_ptr, cnt_ptr, trace_ptr,
                            ltr_ptr, T, S, topk, split_len, sm_scale_log2, NH: gl.constexpr, NSTAGES: gl.constexpr,
                            LWW: gl.constexpr, RING_OFF: gl.constexpr, BAR_OFF: gl.constexpr,
                            EMPTY_OFF: gl.constexpr, RING_WORDS: gl.constexpr, RED: gl.constexpr,
                            RED_L: gl.constexpr, L4: gl.constexpr, OUT_L: gl.constexpr,
                            IDX_L: gl.constexpr,
                            NSPLIT: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
                            SKIP: gl.constexpr, TRACE: gl.constexpr):
    """Grid ``(NSPLIT, T)``: program (split ``sid``, token ``t``) walks entries ``[sid split_len, +split_len)`` of
    the token's list (and below ``len_ptr[t]`` with ``HAS_LEN``); tiles wholly past the end are not copied."""
    t64 = gl.program_id(1).to(gl.int64)
    sid = gl.program_id(0).to(gl.int64)
    start = gl.program_id(0) * split_len
    stop = gl.minimum(start + split_len, topk)
    if HAS_LEN:
        stop = gl.minimum(stop, gl.load(len_ptr + t64))
    n_tiles = gl.maximum(gl.cdiv(stop - start, BN), 0)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    ring = gl.allocate_shared_memory(gl.int32, [RING_WORDS], flat)  # (only ever addressed by its offset)
    full, empty = stage_barriers(NSTAGES, 128)  # (each math thread releases a stage)
    idx_row = idx_ptr + t64 * stride_it
    red = gl.allocate_shared_memory(gl.float32, [4, H, BN], RED)  # the partial logits
    rsum = gl.allocate_shared_memory(gl.float32, [1, H, BN], RED)  # their sums
    gl.warp_specialize([
        (_math, (red, rsum, full, empty, q_ptr, stride_qt, stride_qh, idx_row, o_ptr, lse_ptr, ml_ptr, t64, sid, T,
                 start, stop, n_tiles, S, NH, sm_scale_log2, out_ptr, stride_ot, stride_oh, fl_ptr, fm_ptr, cnt_ptr,
                 sink_ptr, trace_ptr, NSTAGES, RING_OFF, EMPTY_OFF, SKIP, RED_L, L4, OUT_L, IDX_L, NSPLIT, HAS_SINK,
                 TRACE)),
        (_loader, (full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, NSTAGES, RING_OFF, BAR_OFF, 0,
                   LWW, ltr_ptr, sid * T + t64, TRACE)),
        (_loader, (full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, NSTAGES, RING_OFF, BAR_OFF, 1,
                   LWW, ltr_ptr, sid * T + t64, TRACE)),
    ], [LWW, LWW], [48, 48])
    ring._keep_alive()  # (the copies write it by address: never let the unused buffer drop it)


# ------------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------------
def ring_words(stages: int = STAGES) -> dict:
    """The ring's size, ``stages`` tiles of 64 rows of 656 bytes, as ``{"RING_WORDS": int32 words}``: one buffer
    (a shape need not be a power of two when no tensor is loaded from it); :func:`offsets` takes the sizes of a
    ring's buffers in such a dict."""
    return dict(RING_WORDS=stages * BN.value * ROW.value // 4)


def _layouts():
    """(the logits' shared buffer, how each math warp reads the partials of its quarter of the rows, the [1, 4
    groups, 16 heads, 64 rows] layout of the softmax (which also reads the sums back), the output's store, the
    tile's index entries two per lane)."""
    # each head's row of logits in 8-value pieces, piece j of head h at j ^ (h % 4): the 8-byte writes and reads of
    # 16 lanes (the products' stores and the sums' reads: 4 heads x 4 pairs of values; the quarter's partials: 2
    # heads h, h + 2 x 8 pairs) fall on 32 distinct banks, with no padding
    red = gl.SwizzledSharedLayout(8, 1, 4, order=[2, 1, 0])
    ntile = [[0, 0, 8], [0, 0, 16], [0, 0, 32]]
    red_l = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [1, 0, 0], [2, 0, 0], [0, 4, 0], [0, 8, 0]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 2, 0], [0, 1, 0]],
        warp_bases=[[0, 0, 16], [0, 0, 32]], block_bases=[], shape=[4, 16, 64])
    l4 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 8, 0]] + [[0] + t for t in ntile],
        lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=[[0, 1, 0, 0], [0, 2, 0, 0]], block_bases=[], shape=[1, 4, 16, 64])
    # the output's store: 4 lanes x 16 bytes of a head's row per warp instruction (a layout of a thread's 32
    # consecutive values, which needs no shared memory, stores 16 bytes to each of 32 rows per instruction: 2.6 us
    # slower at batch 32)
    out_l = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [4, 1, 1], [2, 1, 0])
    idx_l = gl.DistributedLinearLayout(reg_bases=[[32]], lane_bases=[[1], [2], [4], [8], [16]],
                                       warp_bases=[[0], [0]], block_bases=[], shape=[64])
    return red, red_l, l4, out_l, idx_l


def constexprs(nsplit: int, has_len: bool, has_sink: bool, skip: bool = False, trace: bool = False,
               heads: int = 16) -> dict:
    """The kernel's constexpr arguments (``heads``: the call's h_q, 1 to 16), the shared offsets still 0
    (:func:`resolve_offsets` fills them)."""
    red, red_l, l4, out_l, idx_l = _layouts()
    return dict(NSTAGES=STAGES, LWW=LOADER_WARPS, RING_OFF=0, BAR_OFF=0, EMPTY_OFF=0, RED=red, RED_L=red_l,
                L4=l4,
                OUT_L=out_l, IDX_L=idx_l, NSPLIT=int(nsplit), HAS_LEN=bool(has_len), HAS_SINK=bool(has_sink),
                SKIP=bool(skip), TRACE=bool(trace), NH=int(heads), **ring_words())


def allocated(ttgir: str, capability: int = 90) -> str:
    """The TTGIR after the compiler's shared-memory allocation (the passes ``make_llir`` runs first), as text: its
    ``local_alloc`` ops carry their ``allocation.offset``."""
    from triton._C.libtriton import ir, nvidia, passes

    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir", delete=False) as f:
        f.write(ttgir)
    try:
        mod = ir.parse_mlir_module(f.name, ctx)
    finally:
        os.unlink(f.name)
    pm = ir.pass_manager(ctx)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, 86)
    pm.run(mod, "allocate")
    return str(mod)


def offsets(ttgir: str, parts: dict, stages: int, empty: bool = False):
    """(ring, full-barrier) byte offsets of the compiled kernel's shared memory, from its TTGIR: the ring's buffers
    (int32 of the sizes in ``parts``) must lie side by side (any order), 16-byte aligned; the full barriers are the
    first ``[stages, 1]`` i64 buffer (``empty``: also the empty barriers', the second)."""
    allocs = re.findall(r"ttg\.local_alloc\s*\{allocation\.offset = (\d+) : i32\}\s*:\s*\(\)\s*->\s*"
                        r"!ttg\.memdesc<([0-9x]+)x(i32|i64)", allocated(ttgir))
    sizes = sorted(v for v in parts.values() if v)
    ring = sorted((int(o), int(shape)) for o, shape, ty in allocs if ty == "i32" and "x" not in shape)
    assert sorted(n for _, n in ring) == sizes, (allocs, parts)
    for (o0, n0), (o1, _) in zip(ring, ring[1:]):
        assert o1 == o0 + 4 * n0, f"the ring's buffers are not side by side: {ring}"
    bars = [int(o) for o, shape, ty in allocs if ty == "i64" and shape == f"{stages}x1"]
    assert len(bars) == 2 and ring[0][0] % 16 == 0, allocs
    return (ring[0][0], bars[0], bars[1]) if empty else (ring[0][0], bars[0])


def resolve_offsets(consts: dict, compile_fn) -> dict:
    """Fill the shared offsets of ``consts`` (in place; also returned): ``compile_fn(consts)`` compiles the kernel
    (no launch) and returns it; its allocation gives the offsets, the kernel is compiled again with them, and they
    must not have moved (the code does not depend on them)."""
    offs = offsets(compile_fn(consts).asm["ttgir"], ring_words(), STAGES, True)
    consts.update(RING_OFF=offs[0], BAR_OFF=offs[1], EMPTY_OFF=offs[2])
    again = offsets(compile_fn(consts).asm["ttgir"], ring_words(), STAGES, True)
    assert again == offs, f"the shared offsets moved: {offs} -> {again}"
    return consts


_CONSTS = {}  # (device, constexpr switches) -> the constexprs, offsets resolved
_CHECKED = set()  # those keys with the arguments' specialisation: the compiled variants whose offsets were checked
_ZERO = {}  # device -> the zero row


def _zero_row(dev) -> torch.Tensor:
    """The row the loaders copy for an invalid entry: zero bytes (never written), one per device; a first call
    inside a CUDA-graph capture gets its own (the capture's memset fills it at each replay)."""
    z = _ZERO.get(str(dev))
    if z is None:
        z = torch.zeros(1024, dtype=torch.uint8, device=dev)
        if not torch.cuda.is_current_stream_capturing():
            _ZERO[str(dev)] = _replay.keep(z)
    return z


#: the smallest batch (query tokens) the bulk kernel serves by default (:func:`serves`). H200, topk 2048 of 32K,
#: CUDA graphs, us, against :mod:`dsa.mla.kernel_sm90` (BENCHMARKS.md, twenty-eighth session, call 4): batch 16
#: 18.4 against 15.6, 24 22.1 against 22.4, 32 22.9 against 25.6, 40 27.5 / 38.5, 64 35.6 / 43.8, 80 54.8 / 68.1,
#: 128 58.1 / 73.9, 256 122.7 / 142.4.
MIN_T = 32


def serves(T: int, topk: int) -> bool:
    """Whether a call of ``T`` query tokens with ``topk`` entries each takes this kernel by default (where it
    applies): from ``MIN_T`` tokens on."""
    return T >= MIN_T and topk >= 1


def num_splits_for(T: int, topk: int, num_sms: int) -> int:
    """Programs per token: as many as fill the SMs once (one CTA per SM), at most one per 64-entry tile."""
    return max(1, min(num_sms // max(T, 1), triton.cdiv(topk, BN.value)))


def split_plan(T: int, topk: int, num_splits: int | None, num_sms: int) -> tuple[int, int]:
    """(programs per token, entries per program) for ``num_splits`` requested (``None``: :func:`num_splits_for`):
    whole 64-entry tiles per program, no program without one."""
    tiles = triton.cdiv(max(topk, 1), BN.value)
    if num_splits is None:
        num_splits = num_splits_for(T, topk, num_sms)
    split_len = triton.cdiv(tiles, max(1, min(int(num_splits), tiles))) * BN.value
    return triton.cdiv(max(topk, 1), split_len), split_len


def specialisation(args) -> tuple:
    """What the launcher specialises a compiled variant on, for the kernel's arguments ``args``: each integer's
    divisibility by 16, equality to 1 and width (32 or 64 bits), each tensor's 16-byte alignment (floats: nothing)."""
    return tuple((a % 16 == 0, a == 1, -2**31 <= a < 2**31) if isinstance(a, int) else a.data_ptr() % 16 == 0
                 for a in args if not isinstance(a, float))


def applies(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether :func:`sparse_mla_bulk` can serve the call: 1 to 16 heads, the fp8_ds_mla cache (``kv`` the flat
    ``[S, 656]`` uint8 view, rows contiguous and 16-byte aligned: one bulk copy per row), an NVIDIA Hopper GPU
    without the interpreter, q's and ``out``'s (if given) last dimension and the index rows contiguous, at most
    65535 tokens."""
    from ..backend import on_hopper

    T, h_q, d = q.shape
    if not 1 <= h_q <= H.value or d != D_QK or kv.dtype != torch.uint8 or kv.dim() != 2 or kv.shape[1] != ROW.value:
        return False
    if kv.stride() != (ROW.value, 1):  # (the copies take row i at kv + 656 i)
        return False
    if not on_hopper(q.device) or T > _MAX_T or kv.data_ptr() % 16 or q.stride(2) != 1 or indices.stride(1) != 1:
        return False
    return out is None or out.stride(2) == 1


def sparse_mla_bulk(q, kv, indices, sm_scale, attn_sink=None, topk_length=None, out=None, num_splits=None,
                    skip=False, trace=None, ltrace=None):
    """Sparse MLA over the fp8_ds_mla cache for 1 to 16 heads on sm_90 (validated arguments, :func:`applies`): ``q``
    ``[T, h_q, 576]`` bf16, ``kv`` ``[S, 656]`` uint8, ``indices`` ``[T, topk]`` int32, ``topk_length`` ``[T]``
    int32 or None, ``attn_sink`` ``[h_q]`` f32 or None, ``out`` ``[T, h_q, 512]`` bf16 or None (fewer than 16
    heads: the products run on 16, the missing ones zero, and only the first ``h_q`` are written). Returns
    ``(out, max_logits, lse)`` as :func:`dsa.sparse_mla`. ``num_splits`` (``None``: :func:`num_splits_for`)
    programs per token; ``skip``, ``trace`` (int32 ``[splits T, 4, 128]``), ``ltrace`` (int32 ``[splits T, 2, 2,
    64]``): benchmarks (the copies alone; the math warps' and loaders' clock sums per phase)."""
    T, h_q, _ = q.shape
    S, topk = kv.shape[0], indices.shape[1]
    dev = q.device
    out, ml, lse = outputs(T, h_q, D_V, dev, out)
    if T == 0:
        return out, ml, lse
    ns, split_len = split_plan(T, topk, num_splits, num_sms(dev))
    if ns > 1:
        o_part = torch.empty(ns, T, H.value, D_V, dtype=torch.float32, device=dev)  # (16 heads, whatever h_q)
        lse_part = torch.empty(ns, T, H.value, dtype=torch.float32, device=dev)
        ml_part = torch.empty(ns, T, H.value, dtype=torch.float32, device=dev)
        counters = torch.zeros(T, dtype=torch.int32, device=dev)
    else:
        o_part = lse_part = ml_part = lse  # (unused)
        counters = indices
    has_len, has_sink = topk_length is not None, attn_sink is not None
    args = (q, q.stride(0), q.stride(1), kv, _zero_row(dev), indices, indices.stride(0),
            topk_length if has_len else indices, attn_sink if has_sink else lse, o_part, lse_part, ml_part, out,
            out.stride(0), out.stride(1), lse, ml, counters, trace if trace is not None else indices,
            ltrace if ltrace is not None else indices, T, S, topk, split_len, float(sm_scale) * 1.4426950408889634)
    grid = (ns, T)
    # the constexprs are built once per key (about 170 us of host time each on a CPU); every variant the launcher
    # compiles (one per specialisation: its integers' divisibility by 16, equality to 1 and width, its pointers'
    # 16-byte alignment) has its shared offsets checked once, on the code the launch then runs
    key = (str(dev), ns, has_len, has_sink, bool(skip), trace is not None, h_q)
    spec = key + specialisation(args)
    consts = _CONSTS.get(key)
    warmup = lambda c: _sparse_mla_bulk_kernel.warmup(*args, grid=grid, num_warps=4, **c)  # noqa: E731
    if consts is None:
        consts = _CONSTS[key] = resolve_offsets(constexprs(ns, has_len, has_sink, skip, trace is not None, h_q),
                                                warmup)
        _CHECKED.add(spec)
    elif spec not in _CHECKED:
        got = offsets(warmup(consts).asm["ttgir"], ring_words(), STAGES, True)
        assert got == (consts["RING_OFF"], consts["BAR_OFF"], consts["EMPTY_OFF"]), f"the shared offsets moved: {got}"
        _CHECKED.add(spec)
    _sparse_mla_bulk_kernel[grid](*args, num_warps=4, **consts)
    return out, ml, lse
