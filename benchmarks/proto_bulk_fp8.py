r"""Prototype: small-head fp8_ds_mla sparse-MLA decode fed by a bulk-copy ring, one copy per 656-byte row, the
products on mma.sync with every operand converted in registers.

    python benchmarks/proto_bulk_fp8.py                # H200: correctness against the reference, then timings
    python benchmarks/proto_bulk_fp8.py --compile-only # CPU: compile for sm_90a, print its instruction counts
    python benchmarks/proto_bulk_fp8.py --trace        # H200: the math warps' clocks per tile, by phase
    ncu --clock-control none -k regex:_proto_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis_Tables python benchmarks/proto_bulk_fp8.py --profile

``benchmarks/bulk_gather.py`` found that one CTA per SM copies the fp8 decode rows of batch 64 in 25.5 us (28.1
reading every word) when each row is one bulk copy and 2-4 warps issue them; ``benchmarks/proto_bulk_mla.py``
found that two copies per row (its padded bf16 rows) cost 46-48 us at batch 64 by themselves (BENCHMARKS.md,
twenty-fifth and twenty-sixth sessions). fp8_ds_mla rows need no padding: at 656 bytes (164 words, 4 banks apart)
every row starts on its own bank group of a 16-byte read. So this prototype copies each row whole into a ring of
``STAGES`` 64-row tiles (``global_smem`` plus the offsets of the compiler's allocation pass, as in
``bulk_gather.py``) and reads it back with ``ld.shared.v4`` (inline PTX; Gluon has no view of a 656-byte pitch):

* one CTA per (split, token) of a 16-head group (s_q 1, no ``topk_length``, no sink: a prototype), two loader
  partitions of ``LWW`` warps on alternate tiles; an invalid entry copies a zero row;
* every fp8 operand read 16 contiguous bytes per lane and converted with ``cvt.rn.f16x2.e4m3x2`` (exact) for
  ``mma_v2`` in f16: for QK the k order of each lane's bytes is permuted so that they ARE its operand registers,
  and q is loaded in the same permuted order (the dot product does not care), scaled per group by a power of two
  into f16's range, the row scale multiplying the group's logits afterwards (exact for the writer's power-of-two
  scales); the rope part is bf16 ``mma_v2``; for P.V the B operand pairs two rows' bytes per register (``prmt``
  then ``cvt``), a lane's 16 bytes of a row being 16 output columns ``16 j + c``, put back in order before the
  stores; P times the row's group scale over the tile's largest such scale goes in as f16 (the ratio of successive
  tiles' largest scales folds into the accumulator's rescale);
* the math warps (``HF``): 0, :func:`_math_rq`: 4 warps; QK by rows (warp ``w`` the logits of its 16 rows over
  all 576 values, q read from shared memory each tile), so no partial logits are summed across warps; P.V by
  groups (warp ``w`` the 128 columns of group ``w``), P passed between them by the compiler's layout conversion.
  1 or 2, :func:`_math_hf`: ``4 HF`` warps; QK and P.V both by groups (warp ``b`` group ``b % 4``, rows of range
  ``b // 4``), the four groups' partial logits summed through a swizzled shared buffer, each thread releasing the
  stage by its own arrival (no CTA barrier before the release); with 2 ranges each range is a split of its own;
* split partials in the library's format, merged by its merge kernel (``_sparse_mla_combine_kernel``); or, with
  ``FIN`` (``fin`` 1, 4 math warps), the kernel finishes the call itself: at one split it writes the bf16 output,
  lse and max_logits directly, at more the last program of each token merges the partials (:func:`_finish`).

Measured and dropped (BENCHMARKS.md, twenty-sixth and twenty-seventh sessions; the code is in git history): a
software-pipelined ``_math_hf`` (3bb8da2: it spilled); two groups of 4 math warps on alternate tiles (ping-pong:
with four more warps waiting on the ring's barriers the copies alone took 4-8 us longer); the tile loop unrolled by
two with a logits buffer per tile, for one CTA barrier per tile instead of two (20-30% slower, its loop's code twice
as long). ``HF`` 2 (8 math warps, half of each tile's rows each) stays, and is slower than 4 even in the kernel alone.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa.mla.epilogue import row_stats  # noqa: E402

from bulk_gather import (baseline_and_floor, bulk_walk, compile_sm90, merge_partials, offsets,  # noqa: E402
                         poisoned_case, sass_counts, stage_barriers, zero_row)

BN = gl.constexpr(64)
LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
ROW = gl.constexpr(656)
H = gl.constexpr(16)

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
def _load_q(q_ptr, stride_qt, t64, a_l: gl.constexpr, B: gl.constexpr):
    """q's values ``[B, 16, 128]`` f32 in ``a_l`` (batch ``b``: group ``b % 4``), in the permuted k order of
    :func:`_qk_operand`, and each batch's power of two ``qe`` [B] that puts them in f16's range (largest in
    [2^14, 2^15))."""
    bq = gl.arange(0, B, gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    h = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    k = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    pk = 32 * ((k >> 1) & 3) + 16 * (k >> 6) + 4 * ((k >> 4) & 3) + 2 * ((k >> 3) & 1) + (k & 1)
    qv = gl.load(q_ptr + t64 * stride_qt + h[None, :, None] * 576 + (bq % 4)[:, None, None] * 128
                 + pk[None, None, :]).to(gl.float32)
    qmax = gl.max(gl.max(gl.abs(qv), axis=2), axis=1)
    return qv, gl.where(qmax > 0, 14.0 - gl.floor(gl.log2(gl.where(qmax > 0, qmax, 1.0))), 0.0)


@gluon.jit
def _pv_offsets(B: gl.constexpr, NR: gl.constexpr):
    """Shared offsets within a tile for :func:`_pv_operand`: [B, KK, 2 rb, 8 j, 4 t, 2 e0], row
    ``NR (b // 4) + 16 kk + 8 rb + 2 t + e0``, bytes ``128 (b % 4) + 16 j``."""
    KK: gl.constexpr = NR // 16
    LV: gl.constexpr = gl.BlockedLayout([1, KK, 2, 1, 1, 2], [1, 1, 1, 8, 4, 1], [B, 1, 1, 1, 1, 1],
                                        [5, 2, 1, 4, 3, 0])
    v0 = gl.arange(0, B, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v1 = gl.arange(0, KK, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v2 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v3 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(
        5, LV))))))
    v4 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
        5, LV))))))
    v5 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(
        4, LV))))))
    vrow = (NR * (v0 // 4)[:, None, None, None, None, None] + 16 * v1[None, :, None, None, None, None]
            + 8 * v2[None, None, :, None, None, None] + 2 * v4[None, None, None, None, :, None]
            + v5[None, None, None, None, None, :])
    return vrow * ROW + 128 * (v0 % 4)[:, None, None, None, None, None] + 16 * v3[None, None, None, :, None, None]


@gluon.jit
def _store_partial(o, o_ptr, srow, T, B: gl.constexpr, OL: gl.constexpr):
    """P.V's normalised ``o`` [B, 16, 128] (logical column n holds value 16 (n % 8) + n // 8 of group ``b % 4``)
    into rows ``(srow + (b // 4) T) 16 + head`` of 512 values at ``o_ptr`` (a split partial's slot, ``srow = HF sid
    T + t``, or the final output, ``srow = t``), in ``o_ptr``'s type: put back in order (``OL``), 16-byte stores
    (f32)."""
    o = gl.reshape(gl.permute(gl.reshape(o, [B, H, 16, 8]), [0, 1, 3, 2]), [B, H, 128])
    o = gl.convert_layout(o, OL)
    bo = gl.arange(0, B, gl.SliceLayout(1, gl.SliceLayout(2, OL)))
    ho = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, OL)))
    co = gl.arange(0, 128, gl.SliceLayout(0, gl.SliceLayout(1, OL)))
    orow = (srow + (bo // 4) * T)[:, None, None] * H + ho[None, :, None]
    gl.store(o_ptr + orow * 512 + (bo % 4)[:, None, None] * 128 + co[None, None, :], o.to(o_ptr.dtype.element_ty))


@gluon.jit
def _qk_operand(off, B: gl.constexpr, NR: gl.constexpr):
    """The QK B operand ``[4 g, 128 k, 64 n]`` f16 from ``off`` [4 g, 8 nb, 8 j, 4 t, 2 h] (shared offsets of row
    ``8 nb + j``, bytes ``128 g + 32 t + 16 h``); logical k = 64 h + 16 (m >> 1) + 8 (m & 1) + 2 t + e0 for byte
    ``2 m + e0`` of the load."""
    f = _cvt16(off)  # [4 g, 8 nb, 8 j, 4 t, 2 h, 2 e0, 2 m0, 2 m1, 2 m2]
    f = gl.permute(f, [0, 4, 8, 7, 6, 3, 5, 1, 2])  # [g, h, m2, m1, m0, t, e0, nb, j]
    return gl.reshape(f, [B, 128, NR])


@gluon.jit
def _rope_operand(off, B: gl.constexpr, NR: gl.constexpr):
    """The rope QK B operand ``[4 g, 16 k, 64 n]`` bf16 from ``off`` [4 g, 8 nb, 8 j, 4 t] (row ``8 nb + j``,
    bytes ``528 + 32 g + 8 t``); logical k = 8 r + 2 t + e0 for rope value ``2 r + e0`` of the load."""
    r0, r1 = gl.inline_asm_elementwise(_LD2, "=r,=r,r", [off], dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
    f = gl.join(_halves_bf16(r0), _halves_bf16(r1))  # [g, nb, j, t, e0, r]
    f = gl.permute(f, [0, 5, 3, 4, 1, 2])  # [g, r, t, e0, nb, j]
    return gl.reshape(f, [B, 16, NR])


@gluon.jit
def _pv_operand(off, B: gl.constexpr, NR: gl.constexpr):
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
    f3 = _j4(_halves(u12), _halves(u13), _halves(u14),
             _halves(u15))
    f = _j4(f0, f1, f2, f3)  # [4 g, 4 kk, 2 rb, 8 j, 4 t, 2 e0, 2 c0, 2 c1, 2 c2, 2 c3]
    f = gl.permute(f, [0, 1, 2, 4, 5, 9, 8, 7, 6, 3])  # [g, kk, rb, t, e0, c3, c2, c1, c0, j]
    return gl.reshape(f, [B, NR, 128])


@gluon.jit
def _release(empty, s, EMPTY_OFF: gl.constexpr, NW: gl.constexpr):
    """Release stage ``s``: with ``EMPTY_OFF`` > 0 every thread of the ``NW`` math warps arrives on its ``empty``
    barrier itself (inline PTX at the barrier's shared offset; the barrier counts ``32 NW`` arrivals), after its own
    last read of the stage, with no CTA barrier before it; else one arrival (``mbarrier.arrive``)."""
    if EMPTY_OFF > 0:
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
        gl.inline_asm_elementwise(
            "{ .reg .u32 a; .reg .b64 st; mov.u32 a, global_smem; add.u32 a, a, $1;"
            " mbarrier.arrive.shared::cta.b64 st, [a]; mov.u32 $0, 0; }", "=r,r",
            [gl.full([32 * NW], EMPTY_OFF, gl.int32, lay) + s * 8], dtype=gl.int32, is_pure=False, pack=1)
    else:
        mbarrier.arrive(empty.index(s))


@gluon.jit
def _drain(full, empty, n_tiles, STAGES: gl.constexpr, EMPTY_OFF: gl.constexpr, NW: gl.constexpr):
    """Wait for each tile and release it (``SKIP`` 1: the copies alone)."""
    for i in range(n_tiles):
        mbarrier.wait(full.index(i % STAGES), (i // STAGES) & 1)
        _release(empty, i % STAGES, EMPTY_OFF, NW)


@gluon.jit
def _loader(full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, STAGES: gl.constexpr,
            RING_OFF: gl.constexpr, BAR_OFF: gl.constexpr, W: gl.constexpr, STEP: gl.constexpr, LWW: gl.constexpr,
            ltr_ptr, pid, TRACE: gl.constexpr):
    """Tiles ``W, W + STEP, ...``, each row one bulk copy of 656 bytes; the partition's ``LWW`` warps split a tile's
    rows. ``TRACE``: each thread's clock sums (the wait for a free stage, the copies' issue) go to ``ltr_ptr``
    ``[program pid, loader W, 2, 32 LWW]``."""
    lay: gl.constexpr = gl.BlockedLayout([BN // (32 * LWW)], [32], [LWW], [0])
    r = gl.arange(0, BN, lay)
    n = start + W * BN + r
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)
    if TRACE:
        tl_: gl.constexpr = gl.BlockedLayout([1], [32], [LWW], [0])
        tw = gl.zeros([32 * LWW], gl.int32, tl_)
        ti = gl.zeros([32 * LWW], gl.int32, tl_)
    for i in range(W, n_tiles, STEP):
        s = i % STAGES
        ok = (idx >= 0) & (idx < S)
        src = gl.where(ok, kv_ptr + gl.where(ok, idx, 0).to(gl.int64) * ROW, zero_ptr)
        n = start + (i + STEP) * BN + r  # the next tile's entries, loaded while this one waits for its buffer
        idx = gl.load(idx_row + n, mask=n < stop, other=-1)
        if TRACE:
            c0 = _clock(LWW)
        if i >= STAGES:
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
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
        row = ltr_ptr + ((pid * STEP + W) * 2) * (32 * LWW) + th
        gl.store(row, tw)
        gl.store(row + 32 * LWW, ti)


@gluon.jit
def _sum_logits(red, sp, valid, RED_L: gl.constexpr, p_l: gl.constexpr, HF: gl.constexpr, NR: gl.constexpr):
    """The four groups' partial logits summed through shared memory (one barrier), invalid rows -inf."""
    red.store(sp)
    gl.thread_barrier()
    lg = gl.convert_layout(gl.sum(gl.reshape(red.load(RED_L), [HF, 4, H, NR]), axis=1), p_l)
    return gl.where(gl.expand_dims(valid, 1), lg, float("-inf"))


@gluon.jit
def _pv_step(lg, sc, base, off_pv, acc, m_i, l_i, ms_prev, sm_scale_log2, mma: gl.constexpr, a_l: gl.constexpr,
             b_l: gl.constexpr, L4: gl.constexpr, B: gl.constexpr, HF: gl.constexpr, NR: gl.constexpr):
    """One tile's online softmax and P.V; returns the new (acc, m, l, largest scales)."""
    m_new = gl.maximum(m_i, gl.max(lg, axis=2) * sm_scale_log2)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(lg * sm_scale_log2 - gl.expand_dims(m_use, 2))
    l_i = l_i * alpha + gl.sum(p, axis=2)
    ms = gl.max(sc, axis=1)
    ms = gl.where(ms > 0, ms, 1.0)
    ratio = gl.convert_layout(gl.reshape(sc / ms[:, None], [HF, 4, NR]), gl.SliceLayout(2, L4))
    pw = gl.convert_layout(gl.reshape(gl.expand_dims(p, 1) * gl.expand_dims(ratio, 2), [B, H, NR]), mma)
    al = gl.convert_layout(alpha, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    mr = gl.convert_layout(gl.reshape(ms_prev / ms, [HF, 4]), gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    a3 = gl.convert_layout(gl.reshape(gl.expand_dims(al, 1) * gl.expand_dims(mr, 2), [B, H]), gl.SliceLayout(2, mma))
    vt = gl.convert_layout(_pv_operand(off_pv + base, B, NR), b_l)
    acc = mma_v2(gl.convert_layout(pw.to(gl.float16), a_l), vt, acc * gl.expand_dims(a3, 2))
    return acc, m_new, l_i, ms


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
def _tile_start(i, idx, idx_row, start, stop, rows, S, full, STAGES: gl.constexpr, RING_OFF: gl.constexpr):
    """Tile ``i``'s stage, which of its rows are valid (``idx``: its index entries, ``rows`` their positions in the
    tile), the next tile's entries (loaded now, a tile ahead of their use) and the stage's ring offset, once the
    stage is full."""
    s = i % STAGES
    valid = (idx >= 0) & (idx < S)
    n = start + (i + 1) * BN + rows
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)
    mbarrier.wait(full.index(s), (i // STAGES) & 1)
    return s, valid, idx, RING_OFF + s * (BN * ROW)


@gluon.jit
def _clock(NW: gl.constexpr):
    """Each of the ``NW`` warps' threads' SM clock (``%clock``), one per thread."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [gl.full([32 * NW], 0, gl.int32, lay)],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_hf(i, red, idx, idx_row, start, stop, rows, prow, S, full, empty, off_sc, off_qk, off_rope, off_pv, q16,
             qr, qinv, zs, acc, m_i, l_i, ms_prev, sm_scale_log2, tr, mma: gl.constexpr, a_l: gl.constexpr,
             b_l: gl.constexpr, p_l: gl.constexpr, L4: gl.constexpr, RED_L: gl.constexpr, B: gl.constexpr,
             HF: gl.constexpr, NR: gl.constexpr, STAGES: gl.constexpr, RING_OFF: gl.constexpr,
             EMPTY_OFF: gl.constexpr, TRACE: gl.constexpr, VC: gl.constexpr):
    """Tile ``i`` of :func:`_math_hf` (``idx``: its index entries; returns the next tile's). ``TRACE``: ``tr`` (5
    per-thread clock sums: the wait for the stage, QK and the logits' sum up to its barrier, the softmax and P.V up
    to the release, the rest up to the next tile; and the last clock read) gains this tile's. ``VC``: ``idx`` holds
    the tile's 64 entries two per lane (the same in every warp), their validity moved to the softmax's layout by
    the compiler's conversion (``VC`` 1) or two ballots (``VC`` 2, :func:`_valid_bits` at ``prow``, the rows of
    the softmax's layout); else each thread loads the entries of its own 16 rows."""
    if TRACE:
        t0 = _clock(B)
    s, valid, idx, base = _tile_start(i, idx, idx_row, start, stop, rows, S, full, STAGES, RING_OFF)
    if VC == 1:
        valid = gl.convert_layout(gl.reshape(valid, [HF, NR]), gl.SliceLayout(1, p_l))
    elif VC == 2:
        valid = _valid_bits(valid, rows, prow)
    if TRACE:
        t1 = _clock(B)
    sc = gl.inline_asm_elementwise(_LD1, "=r,r", [off_sc + base], dtype=gl.float32, is_pure=False, pack=1)
    kq = gl.convert_layout(_qk_operand(off_qk + base, B, NR), b_l)
    sp = mma_v2(q16, kq, zs)
    sp = sp * gl.expand_dims(sc * qinv[:, None], 1)
    sp = mma_v2(qr, gl.convert_layout(_rope_operand(off_rope + base, B, NR), b_l), sp)
    lg = _sum_logits(red, sp, valid, RED_L, p_l, HF, NR)
    if TRACE:
        t2 = _clock(B)
    acc, m_i, l_i, ms_prev = _pv_step(lg, sc, base, off_pv, acc, m_i, l_i, ms_prev, sm_scale_log2, mma, a_l, b_l,
                                      L4, B, HF, NR)
    _release(empty, s, EMPTY_OFF, B)
    if TRACE:
        t3 = _clock(B)
        w, q, p, g, last = tr
        tr = (w + (t1 - t0), q + (t2 - t1), p + (t3 - t2), g + gl.where(i > 0, t0 - last, 0), t3)
    return acc, m_i, l_i, ms_prev, idx, tr


@gluon.jit
def _math_hf(red, full, empty, q_ptr, stride_qt, idx_row, o_ptr, lse_ptr, ml_ptr, t64, sid, T, start, stop, n_tiles,
             S, sm_scale_log2, STAGES: gl.constexpr, RING_OFF: gl.constexpr, SKIP: gl.constexpr, HF: gl.constexpr,
             RED_L: gl.constexpr, L4: gl.constexpr, OUT_L: gl.constexpr, FIN: gl.constexpr, NSPLIT: gl.constexpr,
             out_ptr, fl_ptr, fm_ptr, cnt_ptr, EMPTY_OFF: gl.constexpr, sink_ptr, HAS_SINK: gl.constexpr, trace_ptr,
             TRACE: gl.constexpr, VC: gl.constexpr, IDX_L: gl.constexpr):
    """``4 HF`` math warps: warp ``b`` owns value group ``b % 4`` for rows ``[NR (b // 4), +NR)`` of each tile
    (``NR = 64 / HF``); the warps of one row range sum their logits and run their own online softmax, each row range
    being a split of its own in the partials (slot ``HF * sid + b // 4``). ``FIN`` (``HF`` 1): the kernel finishes the
    call itself (:func:`_finish`)."""
    B: gl.constexpr = 4 * HF
    NR: gl.constexpr = BN // HF
    NB: gl.constexpr = NR // 8
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[B, 1, 1], instr_shape=[1, 16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(0, mma, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, mma, 2)
    c_l: gl.constexpr = gl.SliceLayout(1, mma)  # [B, NR]: the rows' group scales
    p_l: gl.constexpr = gl.SliceLayout(1, L4)  # [HF, 16, NR]: a row range's logits
    r_l: gl.constexpr = gl.SliceLayout(2, p_l)  # [HF, 16]: its softmax state
    # ---- q in the permuted k order, f16 scaled per group by a power of two; rope bf16 ----
    qv, qe = _load_q(q_ptr, stride_qt, t64, a_l, B)
    q16 = (qv * gl.exp2(qe)[:, None, None]).to(gl.float16)
    bq = gl.arange(0, B, gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    h = gl.arange(0, H, gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    qrow = q_ptr + t64 * stride_qt + h[None, :, None] * 576
    kr = gl.arange(0, 16, gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    pr = 4 * ((kr >> 1) & 3) + 2 * (kr >> 3) + (kr & 1)
    qr = gl.load(qrow + 512 + (bq % 4)[:, None, None] * 16 + pr[None, None, :])
    # ---- per-thread shared offsets within a tile (the tile's base added per tile) ----
    LQ: gl.constexpr = gl.BlockedLayout([1, NB, 1, 1, 2], [1, 1, 8, 4, 1], [B, 1, 1, 1, 1], [4, 1, 3, 2, 0])
    x0 = gl.arange(0, B, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    x1 = gl.arange(0, NB, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    x2 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    x3 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, LQ)))))
    x4 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LQ)))))
    off_qk = ((NR * (x0 // 4)[:, None, None, None, None] + 8 * x1[None, :, None, None, None]
               + x2[None, None, :, None, None]) * ROW
              + 128 * (x0 % 4)[:, None, None, None, None] + 32 * x3[None, None, None, :, None]
              + 16 * x4[None, None, None, None, :])
    LR: gl.constexpr = gl.BlockedLayout([1, NB, 1, 1], [1, 1, 8, 4], [B, 1, 1, 1], [1, 3, 2, 0])
    r0 = gl.arange(0, B, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LR))))
    r1 = gl.arange(0, NB, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LR))))
    r2 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LR))))
    r3 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LR))))
    off_rope = ((NR * (r0 // 4)[:, None, None, None] + 8 * r1[None, :, None, None] + r2[None, None, :, None]) * ROW
                + 528 + 32 * (r0 % 4)[:, None, None, None] + 8 * r3[None, None, None, :])
    off_pv = _pv_offsets(B, NR)
    sb = gl.arange(0, B, gl.SliceLayout(1, c_l))
    sn = gl.arange(0, NR, gl.SliceLayout(0, c_l))
    off_sc = (NR * (sb // 4)[:, None] + sn[None, :]) * ROW + 512 + 4 * (sb % 4)[:, None]
    # rows of each row range, as the softmax sees them
    vh = gl.arange(0, HF, gl.SliceLayout(1, gl.SliceLayout(1, p_l)))
    vn = gl.arange(0, NR, gl.SliceLayout(0, gl.SliceLayout(1, p_l)))
    rows = NR * vh[:, None] + vn[None, :]  # [HF, NR]
    prow = rows
    if VC:  # (the entries two per lane, the same in every warp: see _tile_hf)
        rows = gl.arange(0, BN, IDX_L)
    # ---- the loop ----
    zs = gl.zeros([B, H, NR], gl.float32, mma)
    acc = gl.zeros([B, H, 128], gl.float32, mma)
    m_i = gl.full([HF, H], float("-inf"), gl.float32, r_l)
    l_i = gl.zeros([HF, H], gl.float32, r_l)
    ms_prev = gl.full([B], 1.0, gl.float32, gl.SliceLayout(1, c_l))
    qinv = gl.convert_layout(gl.exp2(-qe), gl.SliceLayout(1, c_l))
    if SKIP:  # the copies alone
        _drain(full, empty, n_tiles, STAGES, EMPTY_OFF, B)
        n_tiles = 0
    n = start + rows
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)
    z = gl.zeros([32 * B], gl.int32, gl.BlockedLayout([1], [32], [B], [0]))
    tr = (z, z, z, z, z)
    for i in range(n_tiles):
        acc, m_i, l_i, ms_prev, idx, tr = _tile_hf(i, red, idx, idx_row, start, stop, rows, prow, S, full, empty,
                                                   off_sc, off_qk, off_rope, off_pv, q16, qr, qinv, zs, acc, m_i, l_i,
                                                   ms_prev, sm_scale_log2, tr, mma, a_l, b_l, p_l, L4, RED_L, B, HF, NR,
                                                   STAGES, RING_OFF, EMPTY_OFF, TRACE, VC)
    if TRACE:  # [program, 4 sums, thread]
        th = gl.arange(0, 32 * B, gl.BlockedLayout([1], [32], [B], [0]))
        row = trace_ptr + (sid * T + t64) * (4 * 32 * B) + th
        for k in gl.static_range(4):
            gl.store(row + k * (32 * B), tr[k])
    # split partials (the library's format): normalised out, lse and max in log2 units, -inf when empty; or, with
    # FIN and one split, the final values (natural-log lse, +inf when empty)
    empty_row = l_i == 0.0
    inv, lse, _ = row_stats(l_i, m_i, None, None, None, False, True)  # (the split form: log2 units, -inf when empty)
    sh = gl.arange(0, HF, gl.SliceLayout(1, r_l))
    hh = gl.arange(0, H, gl.SliceLayout(0, r_l))
    if FIN and NSPLIT == 1 and HAS_SINK:  # the sink only in the denominator (the lse stays without it)
        sink = gl.load(sink_ptr + hh)[None, :]
        denom = l_i + gl.exp2(gl.where(empty_row, float("-inf"), sink * LOG2E - m_i))
        inv = gl.where(empty_row, 0.0, 1.0 / gl.where(empty_row, 1.0, denom))
    iv = gl.convert_layout(inv, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    mp = gl.convert_layout(gl.reshape(ms_prev, [HF, 4]), gl.SliceLayout(2, gl.SliceLayout(3, L4)))
    f3 = gl.convert_layout(gl.reshape(gl.expand_dims(iv, 1) * gl.expand_dims(mp, 2), [B, H]), gl.SliceLayout(2, mma))
    if FIN and NSPLIT == 1:
        gl.store(fl_ptr + t64 * H + hh[None, :], gl.where(empty_row, float("inf"), lse * LN2))
        gl.store(fm_ptr + t64 * H + hh[None, :], gl.where(empty_row, float("-inf"), m_i * LN2))
        _store_partial(acc * gl.expand_dims(f3, 2), out_ptr, t64, T, B, OUT_L)
    else:
        slot = (HF * sid + sh[:, None]) * T + t64
        gl.store(lse_ptr + slot * H + hh[None, :], lse)
        gl.store(ml_ptr + slot * H + hh[None, :], m_i)
        _store_partial(acc * gl.expand_dims(f3, 2), o_ptr, HF * sid * T + t64, T, B, OUT_L)
        if FIN:
            _finish(o_ptr, lse_ptr, ml_ptr, out_ptr, fl_ptr, fm_ptr, cnt_ptr, T, t64, NSPLIT, sink_ptr, HAS_SINK)


@gluon.jit
def _finish(o_ptr, lse_ptr, ml_ptr, out_ptr, fl_ptr, fm_ptr, cnt_ptr, T, t64, NSPLIT: gl.constexpr, sink_ptr,
            HAS_SINK: gl.constexpr):
    """The split merge inside the kernel: each program counts itself done on the token's counter (after its
    partials are stored); the last of the ``NSPLIT`` merges them all (as ``_sparse_mla_combine_kernel``; the sink
    only in the denominator) into the final ``out`` bf16, natural-log lse (+inf for a row with no valid entry) and
    max_logits, and puts the counter back to 0 for the next call."""
    gl.thread_barrier()  # every warp's partials are stored before the count
    done = gl.atomic_add(cnt_ptr + t64, 1, sem="acq_rel", scope="gpu")
    if done == NSPLIT - 1:
        LM: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # [16 heads, 512]
        hh = gl.arange(0, H, gl.SliceLayout(1, LM))
        cc = gl.arange(0, 512, gl.SliceLayout(0, LM))
        m = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, LM))
        mx = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, LM))
        for sp in gl.static_range(NSPLIT):
            m = gl.maximum(m, gl.load(lse_ptr + (sp * T + t64) * H + hh))
            mx = gl.maximum(mx, gl.load(ml_ptr + (sp * T + t64) * H + hh))
        empty = m == float("-inf")
        m_use = gl.where(empty, 0.0, m)
        acc = gl.zeros([H, 512], gl.float32, LM)
        sumw = gl.zeros([H], gl.float32, gl.SliceLayout(1, LM))
        for sp in gl.static_range(NSPLIT):
            w = gl.exp2(gl.load(lse_ptr + (sp * T + t64) * H + hh) - m_use)
            sumw += w
            acc += w[:, None] * gl.load(o_ptr + ((sp * T + t64) * H + hh)[:, None] * 512 + cc[None, :])
        denom = sumw
        if HAS_SINK:
            denom += gl.exp2(gl.where(empty, float("-inf"), gl.load(sink_ptr + hh) * LOG2E - m_use))
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, denom))
        gl.store(out_ptr + (t64 * H + hh)[:, None] * 512 + cc[None, :], (acc * inv[:, None]).to(gl.bfloat16))
        gl.store(fl_ptr + t64 * H + hh, gl.where(empty, float("inf"), (m_use + gl.log2(gl.where(empty, 1.0, sumw)))
                                            * LN2))
        gl.store(fm_ptr + t64 * H + hh, gl.where(empty, float("-inf"), mx * LN2))
        gl.store(cnt_ptr + t64, 0)


@gluon.jit
def _qk_rows_operand(off):
    """The QK B operand ``[128 k, 64 n]`` f16 of one group for :func:`_math_rq` from ``off`` [4 w, 2 nb, 8 j, 4 t,
    2 h] (row ``32 nb + 8 w + j``: mma_v2 with 4 warps along N gives warp w rows 8 w + 32 nb + j; bytes
    ``128 g + 32 t + 16 h``): k as in :func:`_qk_operand`."""
    f = _cvt16(off)  # [w, nb, j, t, h, e0, m0, m1, m2]
    f = gl.permute(f, [4, 8, 7, 6, 3, 5, 1, 0, 2])  # [h, m2, m1, m0, t, e0, nb, w, j]
    return gl.reshape(f, [128, 64])


@gluon.jit
def _rope_rows_operand(off):
    """The rope QK B operand ``[64 k, 64 n]`` bf16 of :func:`_math_rq` from ``off`` [4 w, 2 nb, 8 j, 4 t, 2 h2]
    (row ``32 nb + 8 w + j``, rope values ``16 t + 8 h2``); logical k = 8 (4 h2 + m) + 2 t + e0 for value
    ``2 m + e0`` of the load."""
    w0, w1, w2, w3 = _ld4(off)
    f = _j4(_halves_bf16(w0), _halves_bf16(w1), _halves_bf16(w2), _halves_bf16(w3))  # [w, nb, j, t, h2, e0, m0, m1]
    f = gl.permute(f, [4, 7, 6, 3, 5, 1, 0, 2])  # [h2, m1, m0, t, e0, nb, w, j]
    return gl.reshape(f, [64, 64])


@gluon.jit
def _math_rq(full, empty, q_ptr, stride_qt, idx_row, o_ptr, lse_ptr, ml_ptr, t64, sid, T, start, stop, n_tiles, S,
             sm_scale_log2, STAGES: gl.constexpr, RING_OFF: gl.constexpr, SKIP: gl.constexpr, QS: gl.constexpr,
             QRS: gl.constexpr, OUT_L: gl.constexpr):
    """4 math warps; QK by rows: warp ``w`` computes the logits of rows ``[16 w, +16)`` over all 576 values (the
    four groups as a batch of ``mma_v2`` in registers, q read from shared memory each tile), so no partial logits
    are summed across warps; P.V by groups as in :func:`_math_hf` (warp ``w`` owns group ``w``'s 128 columns), P
    shared through the compiler's layout conversion."""
    mr2: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    mpv: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8])
    s_l: gl.constexpr = mr2  # [16 heads, 64 rows], warps along the rows
    # ---- q, once: f16 in the permuted k order scaled per group by a power of two, rope bf16; kept in shared memory
    a_pv: gl.constexpr = gl.DotOperandLayout(0, mpv, 2)
    qv, qe = _load_q(q_ptr, stride_qt, t64, a_pv, 4)
    g = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, a_pv)))
    qinv = (gl.exp2(-gl.sum(gl.where(g == 0, qe, 0.0), axis=0)), gl.exp2(-gl.sum(gl.where(g == 1, qe, 0.0), axis=0)),
            gl.exp2(-gl.sum(gl.where(g == 2, qe, 0.0), axis=0)), gl.exp2(-gl.sum(gl.where(g == 3, qe, 0.0), axis=0)))
    q_smem = gl.allocate_shared_memory(gl.float16, [4 * H, 128], QS,
                                       gl.reshape((qv * gl.exp2(qe)[:, None, None]).to(gl.float16), [4 * H, 128]))
    RL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    hr = gl.arange(0, H, gl.SliceLayout(1, RL))
    kr = gl.arange(0, 64, gl.SliceLayout(0, RL))
    pr = 16 * ((kr >> 1) & 3) + 8 * (kr >> 5) + 2 * ((kr >> 3) & 3) + (kr & 1)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [H, 64], QRS,
                                        gl.load(q_ptr + t64 * stride_qt + hr[:, None] * 576 + 512 + pr[None, :]))
    # ---- per-thread shared offsets within a tile ----
    LQ: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 2], [1, 1, 8, 4, 1], [4, 1, 1, 1, 1], [4, 1, 3, 2, 0])
    y0 = gl.arange(0, 4, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    y1 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    y2 = gl.arange(0, 8, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, LQ)))))
    y3 = gl.arange(0, 4, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, LQ)))))
    y4 = gl.arange(0, 2, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LQ)))))
    off_qk = ((8 * y0[:, None, None, None, None] + 32 * y1[None, :, None, None, None]
               + y2[None, None, :, None, None]) * ROW + 32 * y3[None, None, None, :, None]
              + 16 * y4[None, None, None, None, :])  # group 0's bytes; group g at + 128 g
    off_rope = off_qk + 528  # the rope values' 16-byte pieces: the same lanes and rows, 528 bytes further
    off_pv = _pv_offsets(4, 64)
    nq = gl.arange(0, BN, gl.SliceLayout(0, mr2))
    off_scq = nq * ROW + 512  # group g's scale at + 4 g
    cp: gl.constexpr = gl.SliceLayout(1, mpv)  # [4 groups, 64 rows] as P.V needs them
    gp = gl.arange(0, 4, gl.SliceLayout(1, cp))
    np_ = gl.arange(0, BN, gl.SliceLayout(0, cp))
    off_scp = np_[None, :] * ROW + 512 + 4 * gp[:, None]
    cols = gl.arange(0, BN, gl.SliceLayout(0, s_l))
    # ---- the loop ----
    zr = gl.zeros([H, BN], gl.float32, mr2)
    acc = gl.zeros([4, H, 128], gl.float32, mpv)
    m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_acc = gl.zeros([H, BN], gl.float32, s_l)  # per (head, row slot): summed over the rows at the end
    ms_prev = gl.full([4], 1.0, gl.float32, gl.SliceLayout(1, cp))
    if SKIP:  # the copies alone
        _drain(full, empty, n_tiles, STAGES, 0, 4)
        n_tiles = 0
    n = start + cols
    idx = gl.load(idx_row + n, mask=n < stop, other=-1)
    for i in range(n_tiles):
        s, valid, idx, base = _tile_start(i, idx, idx_row, start, stop, cols, S, full, STAGES, RING_OFF)
        kr2 = gl.convert_layout(_rope_rows_operand(off_rope + base), gl.DotOperandLayout(1, mr2, 2))
        lg = mma_v2(qr_smem.load(gl.DotOperandLayout(0, mr2, 2)), kr2, zr)
        for gg in gl.static_range(4):  # each group's logits times its rows' scale and q's inverse power of two
            scq = gl.inline_asm_elementwise(_LD1, "=r,r", [off_scq + (base + 4 * gg)], dtype=gl.float32,
                                            is_pure=False, pack=1)
            kq = gl.convert_layout(_qk_rows_operand(off_qk + (base + 128 * gg)), gl.DotOperandLayout(1, mr2, 2))
            sg = mma_v2(q_smem.slice(H * gg, H, dim=0).load(gl.DotOperandLayout(0, mr2, 2)), kq, zr)
            lg = lg + sg * (scq * qinv[gg])[None, :]
        lg = gl.where(valid[None, :], lg, float("-inf"))  # unscaled: exp2(lg * c - max) is one FMA per value
        m_new = gl.maximum(m_i, gl.max(lg, axis=1) * sm_scale_log2)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(lg * sm_scale_log2 - m_use[:, None])
        l_acc = l_acc * alpha[:, None] + p
        scp = gl.inline_asm_elementwise(_LD1, "=r,r", [off_scp + base], dtype=gl.float32, is_pure=False, pack=1)
        ms = gl.max(scp, axis=1)
        ms = gl.where(ms > 0, ms, 1.0)
        pw = gl.expand_dims(gl.convert_layout(p, gl.SliceLayout(0, mpv)), 0) * gl.expand_dims(scp / ms[:, None], 1)
        al = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(2, mpv)))
        mr = gl.convert_layout(ms_prev / ms, gl.SliceLayout(1, gl.SliceLayout(2, mpv)))
        a3 = gl.expand_dims(gl.expand_dims(al, 0) * gl.expand_dims(mr, 1), 2)
        vt = gl.convert_layout(_pv_operand(off_pv + base, 4, 64), gl.DotOperandLayout(1, mpv, 2))
        acc = mma_v2(gl.convert_layout(pw.to(gl.float16), a_pv), vt, acc * a3)
        gl.thread_barrier()  # every warp is done with the buffer
        mbarrier.arrive(empty.index(s))
        m_i = m_new
        ms_prev = ms
    # the split partial (the library's format): normalised out, lse and max in log2 units, -inf when empty
    l_i = gl.sum(l_acc, axis=1)
    inv, lse, _ = row_stats(l_i, m_i, None, None, None, False, True)  # (the split form: log2 units, -inf when empty)
    hh = gl.arange(0, H, gl.SliceLayout(1, s_l))
    gl.store(lse_ptr + (sid * T + t64) * H + hh, lse)
    gl.store(ml_ptr + (sid * T + t64) * H + hh, m_i)
    iv = gl.convert_layout(inv, gl.SliceLayout(0, gl.SliceLayout(2, mpv)))
    mp = gl.convert_layout(ms_prev, gl.SliceLayout(1, gl.SliceLayout(2, mpv)))
    f3 = gl.expand_dims(gl.expand_dims(iv, 0) * gl.expand_dims(mp, 1), 2)
    _store_partial(acc * f3, o_ptr, sid * T + t64, T, 4, OUT_L)


@gluon.jit
def _proto_kernel(q_ptr, stride_qt, kv_ptr, zero_ptr, idx_ptr, stride_it, o_ptr, lse_ptr, ml_ptr, T, S, topk,
                  split_len, sm_scale_log2, STAGES: gl.constexpr, SKIP: gl.constexpr, LWW: gl.constexpr,
                  RING_OFF: gl.constexpr, BAR_OFF: gl.constexpr, EMPTY_OFF: gl.constexpr, P0: gl.constexpr,
                  P1: gl.constexpr,
                  HF: gl.constexpr, RED: gl.constexpr, RED_L: gl.constexpr,
                  L4: gl.constexpr, OUT_L: gl.constexpr, QS: gl.constexpr, QRS: gl.constexpr, FIN: gl.constexpr,
                  NSPLIT: gl.constexpr, out_ptr, fl_ptr, fm_ptr, cnt_ptr, len_ptr, sink_ptr, HAS_LEN: gl.constexpr,
                  HAS_SINK: gl.constexpr, trace_ptr, ltr_ptr, TRACE: gl.constexpr, VC: gl.constexpr,
                  IDX_L: gl.constexpr):
    """Math warps: ``HF`` 0, :func:`_math_rq` (4 warps); 1 or 2, :func:`_math_hf` (``4 HF`` warps). Two loaders of
    ``LWW`` warps (:func:`_loader`) on alternate tiles. ``FIN`` 1 (``HF`` 1, ``NSPLIT`` programs per token): the
    kernel writes the final ``out`` [T, 16, 512] bf16, ``lse`` and ``max_logits`` itself (:func:`_finish`), with
    the sink ``sink_ptr`` [16] f32 in the denominator when ``HAS_SINK``. ``HAS_LEN``: entries at or past
    ``len_ptr[t]`` (int32 ``topk_length``) are invalid, and tiles wholly past it are not copied."""
    t64 = gl.program_id(1).to(gl.int64)
    sid = gl.program_id(0).to(gl.int64)
    start = gl.program_id(0) * split_len
    stop = gl.minimum(start + split_len, topk)
    if HAS_LEN:
        stop = gl.minimum(stop, gl.load(len_ptr + t64))
    n_tiles = gl.maximum(gl.cdiv(stop - start, BN), 0)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    b0 = gl.allocate_shared_memory(gl.int32, [P0], flat)  # the ring: two power-of-two buffers side by side
    b1 = gl.allocate_shared_memory(gl.int32, [P1], flat)
    full, empty = stage_barriers(STAGES, 1 if HF == 0 else 128 * HF)  # (_math_hf: each math thread releases)
    idx_row = idx_ptr + t64 * stride_it
    if HF == 0:
        gl.warp_specialize([
            (_math_rq, (full, empty, q_ptr, stride_qt, idx_row, o_ptr, lse_ptr, ml_ptr, t64, sid, T, start, stop,
                        n_tiles, S, sm_scale_log2, STAGES, RING_OFF, SKIP, QS, QRS, OUT_L)),
            (_loader, (full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, STAGES, RING_OFF, BAR_OFF,
                       0, 2, LWW, ltr_ptr, 0, 0)),
            (_loader, (full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, STAGES, RING_OFF, BAR_OFF,
                       1, 2, LWW, ltr_ptr, 0, 0)),
        ], [LWW, LWW], [48, 48])
    else:
        red = gl.allocate_shared_memory(gl.float32, [4 * HF, H, BN // HF], RED)
        gl.warp_specialize([
            (_math_hf, (red, full, empty, q_ptr, stride_qt, idx_row, o_ptr, lse_ptr, ml_ptr, t64, sid, T, start,
                        stop, n_tiles, S, sm_scale_log2, STAGES, RING_OFF, SKIP, HF, RED_L, L4, OUT_L, FIN, NSPLIT,
                        out_ptr, fl_ptr, fm_ptr, cnt_ptr, EMPTY_OFF, sink_ptr, HAS_SINK, trace_ptr, TRACE, VC,
                        IDX_L)),
            (_loader, (full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, STAGES, RING_OFF, BAR_OFF,
                       0, 2, LWW, ltr_ptr, sid * T + t64, TRACE)),
            (_loader, (full, empty, kv_ptr, zero_ptr, idx_row, start, stop, n_tiles, S, STAGES, RING_OFF, BAR_OFF,
                       1, 2, LWW, ltr_ptr, sid * T + t64, TRACE)),
        ], [LWW, LWW], [48, 48])
    b0._keep_alive()  # (the copies write them by address: never let an unused buffer drop them)
    b1._keep_alive()


def _parts(stages):
    """The ring as two power-of-two int32 buffers of 16K+ words each (the compiler's 16 KB scratch for the logits'
    sum must not fit between them)."""
    words = stages * 64 * 656 // 4
    p0 = 1 << (words.bit_length() - 1)
    p1 = max(16384, 1 << (words - p0 - 1).bit_length())
    assert p1 <= p0 and p0 + p1 >= words
    return dict(P0=p0, P1=p1)


def _layouts(f):
    """(the logits' shared buffer, how each math warp reads it, the [row ranges, 4 groups, 16 heads, rows] layout of
    the softmax) for ``f`` row ranges of ``64 / f`` rows."""
    b, nr = 4 * f, 64 // f
    lg = lambda x: x.bit_length() - 1  # noqa: E731
    # each head's row of logits in 8-value pieces, piece j of head h at j ^ (h % 4): the 8-byte writes and reads of
    # a quarter warp (4 heads x 4 pairs of values) fall on 32 distinct banks, with no padding
    red = gl.SwizzledSharedLayout(8, 1, 4, order=[2, 1, 0])
    ntile = [[0, 0, 8 << i] for i in range(lg(nr // 8))]
    red_l = gl.DistributedLinearLayout(
        reg_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 8, 0]] + ntile,
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 0, 0], [0, 0, 0]] + ([[4, 0, 0]] if f == 2 else []), block_bases=[], shape=[b, 16, nr])
    l4 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 8, 0]] + [[0] + t for t in ntile],
        lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]],
        warp_bases=[[0, 1, 0, 0], [0, 2, 0, 0]] + ([[1, 0, 0, 0]] if f == 2 else []), block_bases=[],
        shape=[f, 4, 16, nr])
    # the output's store: 4 lanes x 16 bytes of a head's row per warp instruction (a layout of a thread's 32
    # consecutive values, which needs no shared memory, stores 16 bytes to each of 32 rows per instruction: 2.6 us
    # slower at batch 32)
    out_l = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [b, 1, 1], [2, 1, 0])
    # a tile's 64 rows, two per lane, the same in every warp (its index entries with ``VC``)
    idx_l = gl.DistributedLinearLayout(reg_bases=[[32]], lane_bases=[[1], [2], [4], [8], [16]],
                                       warp_bases=[[0]] * lg(b), block_bases=[], shape=[64])
    return red, red_l, l4, out_l, idx_l


def _consts(stages, skip=0, lww=1, hf=1, fin=0, nsplit=1, has_len=0, has_sink=0, trace=0, vc=0):
    assert stages % 2 == 0, "two loaders on alternate tiles: each stage must have one"
    red, red_l, l4, out_l, idx_l = _layouts(max(hf, 1))
    qs = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    qrs = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
    return dict(STAGES=stages, SKIP=skip, LWW=lww, RING_OFF=0, BAR_OFF=0, EMPTY_OFF=0, HF=hf, RED=red, RED_L=red_l,
                L4=l4, OUT_L=out_l, QS=qs, QRS=qrs, FIN=fin, NSPLIT=nsplit, HAS_LEN=has_len, HAS_SINK=has_sink,
                TRACE=trace, VC=vc, IDX_L=idx_l, **_parts(stages))


_PTRS = dict(q_ptr="*bf16", kv_ptr="*u8", zero_ptr="*u8", idx_ptr="*i32", o_ptr="*fp32", lse_ptr="*fp32",
             ml_ptr="*fp32", out_ptr="*bf16", fl_ptr="*fp32", fm_ptr="*fp32", cnt_ptr="*i32", len_ptr="*i32",
             sink_ptr="*fp32", trace_ptr="*i32", ltr_ptr="*i32")


def compile_only(stages=4, skip=0, lww=1, hf=1, fin=0, nsplit=1, has_len=0, has_sink=0, trace=0, vc=0):
    """CPU: compile for sm_90a, resolve the offsets, compile again; print its shared memory and instruction counts."""
    consts = _consts(stages, skip, lww, hf, fin, nsplit, has_len, has_sink, trace, vc)
    parts = _parts(stages)
    nw = 4 * max(hf, 1)
    k = compile_sm90(_proto_kernel, consts, _PTRS, nw, ("sm_scale_log2", ))
    offs = _resolve(consts, k, stages, hf)
    k = compile_sm90(_proto_kernel, consts, _PTRS, nw, ("sm_scale_log2", ))
    assert offsets(k.asm["ttgir"], parts, stages, True) == offs
    print(f"stages {stages}, skip {skip}, warps per loader {lww}, hf {hf}, fin {fin}, splits {nsplit}: ring at "
          f"{consts['RING_OFF']}, barriers at {consts['BAR_OFF']}; shared {k.metadata.shared} B")
    print(sass_counts(k, ("LDS", "LDSM", "HMMA", "STS", "BAR", "STL", "LDL", "UBLKCP", "SHFL", "F2FP", "PRMT")))
    return k


def _resolve(consts, k, stages, hf):
    """Put the shared offsets of the compiled ``k`` into ``consts`` (the empty barriers' only for ``_math_hf``,
    whose threads arrive on them by address); returns (ring, full, empty)."""
    offs = offsets(k.asm["ttgir"], _parts(stages), stages, True)
    consts["RING_OFF"], consts["BAR_OFF"] = offs[:2]
    consts["EMPTY_OFF"] = offs[2] if hf else 0
    return offs


def _math_name(hf, fin, vc=0):
    return ("rq", "g4", "g8")[hf] + "f" * fin + "c" * vc


_OFFS = {}
_COUNTERS = {}


def _counters(T, dev):
    """One int32 counter per token for :func:`_finish`, zeroed once (the last program of a token puts it back)."""
    c = _COUNTERS.get(str(dev))
    if c is None or c.numel() < T:
        c = _COUNTERS[str(dev)] = torch.zeros(max(T, 1024), dtype=torch.int32, device=dev)
    return c


def proto_sparse_mla_fp8(q, kv, idx, sm_scale, num_splits, stages=4, skip=0, lww=1, merge=True, hf=1, poison=False,
                         fin=0, topk_length=None, attn_sink=None, trace=None, vc=0, ltrace=None):
    """fp8_ds_mla cache ``kv`` [S, 656] uint8, ``q`` [T, 16, 576] bf16, ``idx`` [T, topk] int32, ``topk_length`` [T]
    int32 or None, ``attn_sink`` [16] f32 or None: ``(out, max_logits, lse)`` as :func:`dsa.sparse_mla`, through
    this prototype and the library's merge kernel; with ``fin`` 1 (``hf`` 1) the kernel finishes the call itself
    (:func:`_finish`). ``merge`` False (``fin`` 0): the split partials ``(o, max, lse)`` instead. ``trace``: an int32
    tensor of ``[ns T, 4, 128]`` (``hf`` 1) that receives each math thread's clock sums (:func:`_tile_hf`).
    ``vc`` 1 or 2 (``hf`` >= 1): the index entries two per lane (see :func:`_tile_hf`). ``ltrace`` (with
    ``trace``): int32 ``[ns T, 2, 2, 32 lww]``, the loaders' clock sums (:func:`_loader`)."""
    T, h_q, _ = q.shape
    assert h_q == 16 and kv.dtype == torch.uint8 and kv.is_contiguous() and q.stride(2) == 1
    assert not fin or hf == 1
    S, topk = kv.shape[0], idx.shape[1]
    split_len = triton.cdiv(triton.cdiv(topk, 64), num_splits) * 64
    ns = triton.cdiv(topk, split_len)
    nslots = ns * max(hf, 1)  # each row range of a CTA is a split of its own
    dev = q.device
    o_part = torch.empty(nslots, T, h_q, 512, dtype=torch.float32, device=dev)
    lse_part = torch.empty(nslots, T, h_q, dtype=torch.float32, device=dev)
    ml_part = torch.empty(nslots, T, h_q, dtype=torch.float32, device=dev)
    out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, h_q, dtype=torch.float32, device=dev)
    ml = torch.empty(T, h_q, dtype=torch.float32, device=dev)
    if poison:  # (checks: every value must be written)
        for t in (o_part, lse_part, ml_part, out, lse, ml):
            t.fill_(float("nan"))
    has_len, has_sink = int(topk_length is not None), int(attn_sink is not None)
    consts = _consts(stages, skip, lww, hf, fin, ns, has_len, has_sink, int(trace is not None), vc)
    args = (q, q.stride(0), kv, zero_row(656, dev), idx, idx.stride(0), o_part, lse_part, ml_part, T, S, topk,
            split_len, float(sm_scale) * 1.4426950408889634)
    ptrs = dict(out_ptr=out, fl_ptr=lse, fm_ptr=ml, cnt_ptr=_counters(T, dev),
                len_ptr=topk_length if has_len else idx, sink_ptr=attn_sink if has_sink else lse,
                trace_ptr=idx if trace is None else trace, ltr_ptr=idx if ltrace is None else ltrace)
    grid = (ns, T)
    key = (stages, skip, lww, hf, fin, ns, has_len, has_sink, trace is not None, vc)
    if key not in _OFFS:
        k = _proto_kernel.warmup(*args, grid=grid, num_warps=4 * max(hf, 1), **ptrs, **consts)
        offs = _resolve(consts, k, stages, hf)
        k = _proto_kernel.warmup(*args, grid=grid, num_warps=4 * max(hf, 1), **ptrs, **consts)
        assert offsets(k.asm["ttgir"], _parts(stages), stages, True) == offs, "the offsets moved"
        _OFFS[key] = {n: consts[n] for n in ("RING_OFF", "BAR_OFF", "EMPTY_OFF")}
    consts.update(_OFFS[key])
    _proto_kernel[grid](*args, num_warps=4 * max(hf, 1), **ptrs, **consts)
    if fin:
        return out, ml, lse
    if not merge:
        return o_part, ml_part, lse_part
    return merge_partials(o_part, lse_part, ml_part, attn_sink)


def main(configs=((2, 1, 0, 0), (2, 1, 1, 0))):
    """``configs``: (warps per loader, ``hf``, ``fin``, ``vc``) quadruples, each checked and timed."""
    from dsa.bench import mla_inputs
    from dsa.mla import sparse_mla_ref
    from dsa.mla.kernel import sparse_mla_triton

    dev = "cuda"
    sm_scale = 576 ** -0.5
    ms_of = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")  # noqa: E731
    # correctness: invalid entries scattered through the rows, NaN in every unused slot; every split count the
    # timings use; topk_length (0, full, ragged) and a sink in some
    for T, ns, extra in ((3, 4, 0), (32, 4, 0), (64, 2, 0), (3, 1, 0), (128, 1, 0), (3, 4, 1), (64, 2, 1), (128, 1, 1)):
        q, flat, idx = poisoned_case(T, "fp8_ds_mla", dev)
        g = torch.Generator(device=dev).manual_seed(T + 11)
        lens = sink = None
        if extra:
            lens = torch.randint(0, 2049, (T, ), generator=g, device=dev, dtype=torch.int32)
            lens[0], lens[-1] = 2048, 0
            if T > 3:
                lens[1:4] = torch.tensor([1000, 64, 1], dtype=torch.int32, device=dev)
            sink = torch.randn(16, generator=g, device=dev, dtype=torch.float32)
        ref = sparse_mla_ref(q, flat, idx, sm_scale, attn_sink=sink, topk_length=lens)
        for lww, hf, fin, vc in configs:
            for rep in range(2 if fin else 1):  # (twice: the counters must be back at 0 after each call)
                got = proto_sparse_mla_fp8(q, flat, idx, sm_scale, ns, 4, 0, lww, hf=hf, poison=True, fin=fin,
                                           topk_length=lens, attn_sink=sink, vc=vc)
                torch.cuda.synchronize()
                d_out = (got[0].float() - ref[0].float()).abs().max().item()
                ok = torch.isfinite(ref[2])
                d_lse = (got[2][ok] - ref[2][ok]).abs().max().item() if ok.any() else 0.0
                d_ml = (got[1][ok] - ref[1][ok]).abs().max().item() if ok.any() else 0.0
                same_inf = bool(torch.equal(torch.isinf(got[2]), torch.isinf(ref[2]))
                                and torch.equal(torch.isinf(got[1]), torch.isinf(ref[1])))
                print(f"check T {T} splits {ns}{' topk_length + sink' if extra else ''}, loader warps {2 * lww}, "
                      f"math {_math_name(hf, fin, vc)}: max |out - ref| {d_out:.5f} (max |ref| "
                      f"{ref[0].float().abs().max().item():.3f}), max |lse - ref| {d_lse:.2e}, max |max_logits - ref| "
                      f"{d_ml:.2e}, inf pattern {'same' if same_inf else 'DIFFERENT'}, NaN in out: "
                      f"{bool(torch.isnan(got[0]).any())}", flush=True)
    rows = []
    for T in (32, 64, 128):
        q, kv, idx = mla_inputs(T, 16, 2048, T, 32768, "fp8_ds_mla", dev=dev)
        flat = kv.reshape(-1, 656)
        words = flat.view(torch.int32)
        walk_out = torch.empty(T, 2048, dtype=torch.int32, device=dev)
        ms_lib = ms_of(lambda: sparse_mla_triton(q, kv, idx, sm_scale))
        baseline_and_floor(q, kv, idx, sm_scale, 656, "gather, dequantise, bmm")
        for ns in ((4, ) if T == 32 else (2, ) if T == 64 else (1, 2)):
            ms_walk = ms_of(lambda: bulk_walk(words, idx, walk_out, ns, 4, 0, 2, 1, 0, 4))
            for lww, hf, fin, vc in configs:
                try:
                    t = [ms_of(lambda: proto_sparse_mla_fp8(q, flat, idx, sm_scale, ns, 4, sk, lww, mg, hf, fin=fin,
                                                            vc=vc))
                         for sk, mg in ((1, False), (0, False), (0, True))[:3 - fin]]
                    t += t[-1:] * fin  # (the kernel finishes the call itself)
                except Exception as e:
                    print(f"T {T} splits {ns} loader warps {2 * lww} math {_math_name(hf, fin, vc)}: "
                          f"{type(e).__name__}: {e}"[:300], flush=True)
                    continue
                rows.append((T, ns, 2 * lww, _math_name(hf, fin, vc), ms_lib, ms_walk, *t))
                print(f"T {T} splits {ns}, {2 * lww} loader warps, math {rows[-1][3]}: library default "
                      f"{ms_lib * 1e3:.1f} us, bulk "
                      f"walk (waits) {ms_walk * 1e3:.1f}, prototype: copies alone {t[0] * 1e3:.1f}, kernel "
                      f"{t[1] * 1e3:.1f}, whole call {t[2] * 1e3:.1f}", flush=True)
    print("\nus; 'walk': bulk_gather.py's copies alone (2 loaders, 4 stages, waits); prototype: its copies alone, "
          "its kernel, the whole call (the kernel, then the merge kernel unless 'f')")
    print("math: 'rq' rows-QK (_math_rq, 4 warps), 'g4'/'g8' groups-QK (_math_hf, 4/8 warps), 'f' the kernel "
          "finishes the call (_finish), 'c' the index entries two per lane (vc)")
    print(f"{'batch':>5} {'splits':>6} {'loaders':>7} {'math':>4} {'default':>7} {'walk':>6} {'copies':>6} "
          f"{'kernel':>6} {'whole':>6}")
    for r in rows:
        print(f"{r[0]:5d} {r[1]:6d} {r[2]:7d} {r[3]:>4} "
              + " ".join(f"{x * 1e3:{w}.1f}" for x, w in zip(r[4:], (7, 6, 6, 6, 6))))


def trace_phases(cases=((32, 4), (64, 2), (128, 1)), vcs=(0, 1, 2)):
    """H200: where the math warps' tile goes (clock sums per tile, ``fin`` 1, 4 loader warps), beside the time of
    the call with and without the trace."""
    from dsa.bench import mla_inputs

    ms_of = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")  # noqa: E731
    names = ("wait for the stage (and the barrier before it)", "QK + logits sum", "softmax + P.V + release",
             "to the next tile")
    for (T, ns), vc in ((c, z) for c in cases for z in vcs):
        q, kv, idx = mla_inputs(T, 16, 2048, T, 32768, "fp8_ds_mla", dev="cuda")
        flat = kv.reshape(-1, 656)
        tr = torch.zeros(ns * T, 4, 128, dtype=torch.int32, device="cuda")
        ltr = torch.zeros(ns * T, 2, 2, 64, dtype=torch.int32, device="cuda")
        call = lambda t: proto_sparse_mla_fp8(q, flat, idx, 576 ** -0.5, ns, lww=2, fin=1, trace=t,  # noqa: E731
                                              vc=vc, ltrace=None if t is None else ltr)
        call(tr)
        torch.cuda.synchronize()
        tiles = 2048 // 64 // ns
        per_tile = tr.double().mean(dim=(0, 2)) / tiles
        ms0, ms1 = ms_of(lambda: call(None)), ms_of(lambda: call(tr))
        print(f"T {T}, {ns} splits ({tiles} tiles per program), vc {vc}: {ms0 * 1e3:.1f} us, "
              f"traced {ms1 * 1e3:.1f} us; "
              f"clocks per tile: " + ", ".join(f"{n} {c:.0f}" for n, c in zip(names, per_tile.tolist()))
              + f"; total {per_tile.sum().item():.0f}; each loader, per tile of its own: wait for a free stage "
              f"{ltr[:, :, 0].double().mean().item() / (tiles / 2):.0f}, issue "
              f"{ltr[:, :, 1].double().mean().item() / (tiles / 2):.0f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--profile", action="store_true", help="two calls at batch 64, 2 splits, for Nsight Compute")
    ap.add_argument("--trace", action="store_true", help="the math warps' clocks per tile (trace_phases)")
    ap.add_argument("--hf", type=int, default=0, help="--profile's math warps (see _consts)")
    ap.add_argument("--configs", default="2,1,0 2,1,1",
                    help="the checked and timed (warps per loader, hf, fin[, vc]) tuples")
    a = ap.parse_args()
    if a.trace:
        trace_phases()
    elif a.profile:
        from dsa.bench import mla_inputs

        q, kv, idx = mla_inputs(64, 16, 2048, 64, 32768, "fp8_ds_mla", dev="cuda")
        for _ in range(2):
            proto_sparse_mla_fp8(q, kv.reshape(-1, 656), idx, 576 ** -0.5, 2, lww=2, merge=False, hf=a.hf)
        torch.cuda.synchronize()
    elif a.compile_only:
        for args in ((4, 0, 1, 0), (4, 1, 1, 0), (4, 0, 2, 1), (4, 0, 2, 1, 1, 1), (4, 0, 2, 1, 1, 4), (4, 0, 1, 2)):
            compile_only(*args)
    else:
        main(tuple((tuple(int(x) for x in c.split(',')) + (0, ))[:4] for c in a.configs.split()))
