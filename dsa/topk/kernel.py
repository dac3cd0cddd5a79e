"""Triton kernels for the indexer top-k (exact threshold selection, no sort, no torch.topk).

Semantics: :mod:`dsa.topk.reference` (canonical choice: larger order key first, lowest
position among ties; positions written ascending; ``-1`` padding). The kernels return
exactly the reference's tensor, for every launch configuration.

Design (one row = one fp32 range ``logits[i, s:e]`` of length ``L``; rows with ``L <= k``
just get ``0..L-1, -1, ...``):

1. **Order keys.** fp32 -> uint32 keys that sort like the values (sign-flip trick);
   NaN and ``-inf`` get key 0, the lowest. Candidate tiles use key + 1 (0 = empty slot).
2. **Sampled lower bound.** ``GROUPS`` runs of 8 contiguous values spread evenly over
   the row (2048 values by default, one 32-byte sector per run) give a bound ``thr``:
   the r-th largest sample key with ``r = 1.5 m + 4 sqrt(m) + 16`` where ``m`` is the
   number of samples expected above the row's k-th largest value, rounded down to
   16 bits. Short rows (``L <= sample size``) are sampled whole with ``r = k``.
   ``thr`` is only a guess: correctness never depends on it (step 5).
3. **One streaming pass.** The row is read once, in ``[BLOCK / E, E]`` tiles (16-byte
   loads when rows are 16-byte aligned; ``PREFETCH`` blocks in flight ahead of the one
   processed). Values with ``x >= float(thr)`` are appended, in position order, to a
   candidate buffer of ``CAP`` packed entries (value bits << 32 | position; global
   scratch private to the program, so it stays in L2) through a two-level prefix sum
   (along the tile rows, then over row totals: few warp shuffles). When the buffer may not
   hold another block, it is cut to its canonical top-k in place and the bound is raised
   to just above the new k-th largest key (later equal keys have larger positions and
   lose the tie), so the pass never restarts and ``CAP >= k + BLOCK`` always suffices.
4. **Exact selection** on the buffer: the k-th largest key ``T`` by a bitwise search over
   the key bits in which the candidates differ, on a register tile of keys (each step one
   count ``sum(key >= cand)``; it stops as soon as a count equals k), then, in chunks of
   ``CH`` entries, every key ``> T`` and the first ``k - #(> T)`` keys ``== T`` (prefix
   counts), written in position order.
5. **Exactness.** The candidates are a superset of the canonical top-k whenever at least
   k values pass the sampled bound; if fewer pass (the sample misled), the row is
   streamed again with no bound (never happens on i.i.d. data; costs one extra pass on
   adversarial rows). No atomics anywhere: the output is bitwise deterministic.

Work split. Many rows (M >= #SMs): persistent programs (``programs_per_sm`` per SM) take
rows in turn, steps 2-4 fused in one kernel. Few long rows (decode): each row is cut into
``SPLITS`` slices handled by separate programs (each keeps the canonical top-k of its
slice above the row's shared sampled bound), then a merge kernel selects the top-k of the
union (``SPLITS * next_pow2(k)`` keys in registers) and writes the output; if the union
holds fewer than k candidates the merge program streams its row alone, unbounded.

Global slots (decode form with a block table, ``SLOTS``): once a row's positions are written, the program maps
them through its request's block-table row in one pass (:func:`_slots_pass`, with
:func:`dsa.metadata.kernel.global_slot`, the code of :func:`dsa.metadata.convert_req_index_to_global_index`),
which saves that conversion's launch. Without it the
kernels compile as before the option existed.

Stores. The appends and the output writes go to data-dependent addresses. ``tl.store`` would move
pointers, values and masks to another register layout through shared memory first (three layout
conversions per streamed block, 8 of its 17 barriers on sm_90); compiled for CUDA, the kernels use one
predicated ``st.global`` of inline PTX per element instead (``TopKConfig.ptx``; the interpreter and
other targets take ``tl.store``). Measured on the H200: 4096 x 131072 from 1.94 to 1.47 ms.

Performance (H200, k = 2048, N(0,1) logits, inputs rotated out of L2; numbers in BENCHMARKS.md):
4096 x 131072 in 1.13 ms (sweep; 5.5x torch.topk's 6.19 ms) with the defaults below: 4-warp programs
capped at 64 registers (8 resident per SM), 32 per SM in the grid, so about one row each. 64 x 131072
(decode, 4 slices per row): 38.6 us of GPU time (CUDA graph; split 23 us + merge 15-18 us); called
eagerly, host-side validation and two launches add 50-80 us.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from ..backend import compiled_nvidia, num_sms, nvidia_options
from ..metadata.kernel import global_slot

MAX_K = 8192  # largest supported k (register tiles of up to 16384 candidates)
_MAX_MERGE_TILE = 16384  # SPLITS * next_pow2(k) candidates held by one merge program
_RUN = 8  # contiguous values per sample run (one 32-byte sector)


# ----------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------
@triton.jit
def _keys(x):
    """fp32 -> uint32 order key; NaN and -inf -> 0."""
    b = x.to(tl.uint32, bitcast=True)
    key = tl.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)
    return tl.where(x > float("-inf"), key, tl.zeros_like(key))


@triton.jit
def _key_to_float(u):
    """Smallest fp32 whose key is >= u (keys 1..0x7FFFFF, which no value has, give -inf)."""
    u = tl.maximum(u, tl.full([], 0x007FFFFF, tl.uint32))
    b = tl.where(u >= 0x80000000, u ^ 0x80000000, u ^ 0xFFFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _pack(x, pos):
    """Candidate entry: fp32 value bits in the high word, position in the low word."""
    return (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | pos.to(tl.int64)


@triton.jit
def _tile_keys(w, valid):
    """Shifted keys of packed candidates: key + 1 where valid (so >= 1), 0 where not."""
    return tl.where(valid, _keys((w >> 32).to(tl.int32).to(tl.float32, bitcast=True)) + 1, 0)


@triton.jit
def _kth_largest(key, r, LOW_BIT: tl.constexpr):
    """Largest T >= 1 with bits below LOW_BIT zero (or T = 1) such that #(key >= T) >= r,
    for shifted keys (0 = not a candidate). Requires #(key >= 1) >= r.

    Bitwise search from the highest bit in which the candidates differ; stops early once
    a count equals r (T is then a valid answer, just not the largest one).
    """
    kmax = tl.max(key, axis=0)
    kmin = tl.min(tl.where(key > 0, key, 0xFFFFFFFF), axis=0)
    diff = kmax ^ kmin
    # highest differing bit; an over-estimate only costs an extra step
    top = (tl.log2(tl.maximum(diff, 1).to(tl.float32))).to(tl.int32) + 1
    bit = tl.maximum(tl.minimum(top, 31), LOW_BIT)
    one = tl.full([], 1, tl.uint32)
    low_mask = (tl.full([], 2, tl.uint32) << bit.to(tl.uint32)) - one
    t = tl.where(diff == 0, kmin, kmin & (low_mask ^ 0xFFFFFFFF))
    go = diff != 0
    while go:
        cand = t | (one << bit.to(tl.uint32))  # >= 1: never counts a non-candidate
        cnt = tl.sum((key >= cand).to(tl.int32), axis=0)
        t = tl.where(cnt >= r, cand, t)
        go = (cnt != r) & (bit > LOW_BIT)
        bit -= 1
    return tl.maximum(t, one)


@triton.jit
def _prefix(v):
    """Inclusive prefix sums of a [R, E] int32 tile in row-major order, and its total.

    Two levels (along each row, then over row totals): Triton puts a row's E entries in
    one or a few threads, so this takes far fewer warp shuffles than a flat 1-D scan."""
    rowtot = tl.sum(v, axis=1)
    rowoff = tl.cumsum(rowtot, axis=0) - rowtot
    return tl.cumsum(v, axis=1) + rowoff[:, None], tl.sum(rowtot, axis=0)


@triton.jit
def _threshold(key, k):
    """For a tile of shifted keys with #(key >= 1) >= k: (T, need) = the k-th largest key
    and how many keys equal to T the canonical top-k takes (k - #(key > T))."""
    t = _kth_largest(key, k, 0)
    t = tl.min(tl.where(key >= t, key, 0xFFFFFFFF), axis=0)  # exact k-th largest key
    need = k - tl.sum((key > t).to(tl.int32), axis=0)
    return t, need


@triton.jit
def _emit(src, cnt, t, need, base_gt, base_eq, dst, TO_BUFFER: tl.constexpr, CH: tl.constexpr,
          E: tl.constexpr, ASM: tl.constexpr):
    """Write the selected entries among src[0:cnt), in order: keys > t, and keys == t while
    at most `need` were taken in all; as packed entries to dst (TO_BUFFER, may alias src) or
    as int32 positions. base_gt/base_eq count the entries > t / == t met before this range;
    the updated counts are returned. Works in chunks of CH (the region must hold a multiple
    of CH entries >= cnt)."""
    ROWS: tl.constexpr = CH // E
    j = tl.arange(0, ROWS)[:, None] * E + tl.arange(0, E)[None, :]  # [ROWS, E], row-major order
    c0 = cnt * 0
    while c0 < cnt:
        ii = tl.multiple_of(c0, CH) + j
        w = tl.load(src + ii)  # unmasked (whole chunk inside the region); ii >= cnt ignored
        key = _tile_keys(w, ii < cnt)
        gt = key > t
        eq = key == t
        # one prefix sum for both counts (16 bits each: chunks are <= 32768 entries)
        c, tot = _prefix(gt.to(tl.int32) + (eq.to(tl.int32) << 16))
        c_eq = base_eq + (c >> 16)
        sel = gt | (eq & (c_eq <= need))
        slot = base_gt + (c & 0xFFFF) + tl.minimum(c_eq, need) - 1  # slot <= ii: in-place safe
        tl.debug_barrier()  # this chunk is read before dst (maybe src) is written
        if TO_BUFFER:
            _scatter(dst + slot, w, sel, ASM)
        else:
            _scatter(dst + slot, w.to(tl.int32), sel, ASM)
        base_gt += tot & 0xFFFF
        base_eq += tot >> 16
        c0 += CH
    return base_gt, base_eq


@triton.jit
def _compact(buf, n, k, dst, TILE: tl.constexpr, TO_BUFFER: tl.constexpr, CH: tl.constexpr,
             E: tl.constexpr, ASM: tl.constexpr):
    """Cut the first n buffer entries (n >= k) to their canonical top-k, written in order to
    dst (the buffer itself when TO_BUFFER, else an int32 output row). Returns the k-th largest
    shifted key (key + 1)."""
    tl.debug_barrier()  # earlier stores of this program are visible
    i = tl.arange(0, TILE)
    # the key tile is the only big live value; unmasked load (the region holds TILE entries)
    t, need = _threshold(_tile_keys(tl.load(buf + i), i < n), k)
    zero = n * 0
    _emit(buf, n, t, need, zero, zero, dst, TO_BUFFER, CH, E, ASM)
    return t


@triton.jit
def _scatter(ptrs, val, mask, ASM: tl.constexpr):
    """``tl.store(ptrs, val, mask)`` of int64 or int32 values at data-dependent addresses. With ASM
    (compiled for CUDA), one predicated ``st.global`` per element in the values' own register layout:
    ``tl.store`` first moves pointers, values and mask to another layout through shared memory
    (three layout conversions, 8 of the 17 barriers of each streamed block on sm_90)."""
    if ASM:
        if val.dtype == tl.int64:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,l,r", [ptrs.to(tl.int64, bitcast=True), val, mask.to(tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,r", [ptrs.to(tl.int64, bitcast=True), val, mask.to(tl.int32)],
                dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, val, mask=mask)


@triton.jit
def _append(buf, slot, x, pos, mask, ASM: tl.constexpr):
    """``buf[slot] = _pack(x, pos)`` where mask. With ASM: one ``mad.wide`` for the address and one
    predicated 8-byte store of (position, value bits) per element, in the values' own layout."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 a; setp.ne.b32 p, $4, 0; mad.wide.s32 a, $2, 8, $1; "
            "@p st.global.v2.b32 [a], {$3, $5}; mov.b32 $0, 0; }",
            "=r,l,r,r,r,r", [buf.to(tl.int64, bitcast=True), slot, pos, mask.to(tl.int32),
                             x.to(tl.int32, bitcast=True)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(buf + slot, _pack(x, pos), mask=mask)


@triton.jit
def _load_range(x_row, idx, lo, hi):
    return tl.load(x_row + idx, mask=(idx >= lo) & (idx < hi), other=float("-inf"))


@triton.jit
def _stream(x_row, a, b, s, f_thr, pass_all, buf, k, CAP: tl.constexpr, BLOCK: tl.constexpr,
            CH: tl.constexpr, E: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr,
            ASM: tl.constexpr):
    """Append the values of x_row[a:b] that pass the bound to the buffer (positions relative
    to s); cut the buffer to its top-k whenever it may not hold another block. Returns the
    entry count.

    Blocks start at multiples of ALIGN columns and loads are masked at ALIGN granularity
    (ALIGN = 4 when rows are 16-byte aligned: 16-byte loads, a few values outside [a, b)
    of the same row are read and ignored; else 1). PREFETCH (1 to 4) blocks are in flight
    ahead of the one being processed."""
    tl.debug_barrier()  # the buffer may still be read/written by an earlier phase
    ROWS: tl.constexpr = BLOCK // E
    offs = tl.arange(0, ROWS)[:, None] * E + tl.arange(0, E)[None, :]  # [ROWS, E], row-major order
    n = tl.zeros([], tl.int32)
    lo = (a // ALIGN) * ALIGN
    hi = ((b + ALIGN - 1) // ALIGN) * ALIGN
    off = lo
    # (while loops: a tensor-bounded `range` trips Triton's interpreter under numpy 2.4)
    while off < b:
        # stream while the buffer has room for one more block; the prefetched blocks are
        # dropped (and re-read) when the buffer is cut, so they are not live during the cut
        idx = tl.multiple_of(off, ALIGN) + offs
        x1 = _load_range(x_row, idx, lo, hi)
        x2 = x1
        x3 = x1
        x4 = x1
        if PREFETCH >= 2:
            x2 = _load_range(x_row, idx + BLOCK, lo, hi)
        if PREFETCH >= 3:
            x3 = _load_range(x_row, idx + 2 * BLOCK, lo, hi)
        if PREFETCH >= 4:
            x4 = _load_range(x_row, idx + 3 * BLOCK, lo, hi)
        while (off < b) & (n <= CAP - BLOCK):
            idx = tl.multiple_of(off, ALIGN) + offs
            x = x1
            xn = _load_range(x_row, idx + PREFETCH * BLOCK, lo, hi)  # prefetch
            if PREFETCH == 1:
                x1 = xn
            elif PREFETCH == 2:
                x1 = x2
                x2 = xn
            elif PREFETCH == 3:
                x1 = x2
                x2 = x3
                x3 = xn
            else:
                x1 = x2
                x2 = x3
                x3 = x4
                x4 = xn
            p = ((idx - a).to(tl.uint32) < (b - a).to(tl.uint32)) & ((x >= f_thr) | (pass_all != 0))  # a <= idx < b
            c, tot = _prefix(p.to(tl.int32))
            _append(buf, (n - 1) + c, x, idx - s, p, ASM)
            n += tot
            off += BLOCK
        if n > CAP - BLOCK:  # cut the buffer to the top-k and raise the bound
            t = _compact(buf, n, k, buf, CAP, True, CH, E, ASM)
            n = n * 0 + k
            f_thr = _key_to_float(t)  # shifted k-th key = k-th key + 1: ties at it are out
            pass_all = pass_all * 0
    return n


@triton.jit
def _sample_threshold(x_seg, length, k, GROUPS: tl.constexpr):
    """Sampled lower-bound key for the row's k-th largest (0 = no bound). length > k."""
    S: tl.constexpr = GROUPS * 8
    i = tl.arange(0, S)
    stride = tl.maximum(length // GROUPS, 8)
    off = (i // 8) * stride + (i % 8)
    valid = off < length
    x = tl.load(x_seg + off, mask=valid, other=float("-inf"))
    ns = tl.minimum(length, S)
    m = ns.to(tl.float32) * k / length.to(tl.float32)
    r = (1.5 * m + 4.0 * tl.sqrt(m) + 16.0).to(tl.int32) + 1
    r = tl.where(ns == length, k, r)  # the whole row is the sample: exact rank
    thr = tl.zeros([], tl.uint32)
    if r <= ns:
        key = tl.where(valid, _keys(x) + 1, 0)
        thr = _kth_largest(key, r, 16) - 1  # back from shifted keys
    return thr


@triton.jit
def _row_range(row, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, MODE: tl.constexpr):
    if MODE == 0:
        s = tl.load(starts_ptr + row)
        e = tl.load(ends_ptr + row)
    else:
        bq = row // next_n
        j = row - bq * next_n
        s = row * 0
        if MODE == 1:
            e = tl.load(seq_ptr + bq) - next_n + j + 1
        else:
            e = tl.load(seq_ptr + bq * seq_stride + j)
    s = tl.minimum(tl.maximum(s, 0), N)
    e = tl.minimum(tl.maximum(e, s), N)
    return s, e


@triton.jit
def _slots_pass(out_row, k, KP: tl.constexpr, bt_row, stride_btb, max_blocks, BS: tl.constexpr):
    """Map the row's k written positions to global cache slots in place
    (:func:`~dsa.metadata.kernel.global_slot`), all in one pass after the output step: the block-table loads of
    every entry are issued together (mapped inside the output step's chunks they were one more dependent memory
    round trip per chunk: 42.0 against 39.6 us for top-k + the conversion kernel, H200, 64 x 131072)."""
    tl.debug_barrier()  # the output step's stores (any thread of the program) are visible
    kk = tl.arange(0, KP)
    pos = tl.load(out_row + kk, mask=kk < k, other=-1)
    tl.store(out_row + kk, global_slot(pos, bt_row, stride_btb, max_blocks, pos >= 0, BS)[0], mask=kk < k)


@triton.jit
def _write_iota(out_row, length, k, KP: tl.constexpr, bt_row, stride_btb, max_blocks, SLOTS: tl.constexpr,
                BS: tl.constexpr):
    kk = tl.arange(0, KP)
    pos = tl.where(kk < length, kk, -1)
    if SLOTS:
        pos = global_slot(pos, bt_row, stride_btb, max_blocks, pos >= 0, BS)[0]
    tl.store(out_row + kk, pos, mask=kk < k)


@triton.jit
def _bt_row(bt_ptr, stride_bt, row, next_n, SLOTS: tl.constexpr):
    """The block-table row of output row ``row`` (decode form: request ``row // next_n``)."""
    if SLOTS:
        return bt_ptr + (row // next_n).to(tl.int64) * stride_bt
    return bt_ptr


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["k", "M", "N", "stride_xm", "stride_bt", "stride_btb", "max_blocks"])
def _topk_fused_kernel(
    x_ptr, stride_xm, M, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, k,
    out_ptr, stride_om, buf_ptr, bt_ptr, stride_bt, stride_btb, max_blocks,
    MODE: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, GROUPS: tl.constexpr, KP: tl.constexpr,
    CH: tl.constexpr, E: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr,
    ASM: tl.constexpr, SLOTS: tl.constexpr, BS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    buf = buf_ptr + pid.to(tl.int64) * CAP
    row = pid
    while row < M:
        s, e = _row_range(row, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, MODE)
        length = e - s
        x_row = x_ptr + row.to(tl.int64) * ((stride_xm // ALIGN) * ALIGN)  # == stride_xm (host checks stride % ALIGN == 0); tells the compiler it is a multiple of ALIGN
        out_row = out_ptr + row.to(tl.int64) * stride_om
        bt_row = _bt_row(bt_ptr, stride_bt, row, next_n, SLOTS)
        if length <= k:
            _write_iota(out_row, length, k, KP, bt_row, stride_btb, max_blocks, SLOTS, BS)
        else:
            thr = _sample_threshold(x_row + s, length, k, GROUPS)
            f_thr = _key_to_float(thr)
            pass_all = (thr == 0).to(tl.int32)
            n = tl.zeros([], tl.int32)
            tries = tl.zeros([], tl.int32)
            while tries < 2:
                n = _stream(x_row, s, e, s, f_thr, pass_all, buf, k, CAP, BLOCK, CH, E, ALIGN, PREFETCH, ASM)
                tries = tl.where(n >= k, 2, tries + 1)
                f_thr = tl.full([], float("-inf"), tl.float32)  # retry (rare): no bound
                pass_all = tl.full([], 1, tl.int32)
            _compact(buf, n, k, out_row, CAP, False, CH, E, ASM)
            if SLOTS:
                _slots_pass(out_row, k, KP, bt_row, stride_btb, max_blocks, BS)
        row += nprog


@triton.jit(do_not_specialize=["k", "N", "stride_xm"])
def _topk_split_kernel(
    x_ptr, stride_xm, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, k,
    buf_ptr, cnt_ptr,
    MODE: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, GROUPS: tl.constexpr,
    CH: tl.constexpr, E: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr,
    ASM: tl.constexpr,
):
    row = tl.program_id(0)
    sp = tl.program_id(1)
    s, e = _row_range(row, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, MODE)
    length = e - s
    if length > k:
        x_row = x_ptr + row.to(tl.int64) * ((stride_xm // ALIGN) * ALIGN)  # == stride_xm (host checks stride % ALIGN == 0); tells the compiler it is a multiple of ALIGN
        buf = buf_ptr + (row.to(tl.int64) * SPLITS + sp) * CAP
        chunk = (tl.cdiv(length, SPLITS) + 63) // 64 * 64
        a = tl.minimum(s + sp * chunk, e)
        b = tl.minimum(a + chunk, e)
        thr = _sample_threshold(x_row + s, length, k, GROUPS)
        n = _stream(x_row, a, b, s, _key_to_float(thr), (thr == 0).to(tl.int32), buf, k, CAP, BLOCK, CH, E, ALIGN, PREFETCH, ASM)
        if n > k:
            _compact(buf, n, k, buf, CAP, True, CH, E, ASM)
            n = n * 0 + k
        tl.store(cnt_ptr + row * SPLITS + sp, n)


@triton.jit(do_not_specialize=["k", "N", "stride_xm", "stride_bt", "stride_btb", "max_blocks"])
def _topk_merge_kernel(
    x_ptr, stride_xm, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, k,
    out_ptr, stride_om, buf_ptr, cnt_ptr, bt_ptr, stride_bt, stride_btb, max_blocks,
    MODE: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, CAP: tl.constexpr, KP: tl.constexpr,
    CH: tl.constexpr, E: tl.constexpr, ALIGN: tl.constexpr, PREFETCH: tl.constexpr,
    ASM: tl.constexpr, SLOTS: tl.constexpr, BS: tl.constexpr,
):
    row = tl.program_id(0)
    s, e = _row_range(row, N, starts_ptr, ends_ptr, seq_ptr, seq_stride, next_n, MODE)
    length = e - s
    out_row = out_ptr + row.to(tl.int64) * stride_om
    bt_row = _bt_row(bt_ptr, stride_bt, row, next_n, SLOTS)
    if length <= k:
        _write_iota(out_row, length, k, KP, bt_row, stride_btb, max_blocks, SLOTS, BS)
    else:
        total = tl.sum(tl.load(cnt_ptr + row * SPLITS + tl.arange(0, SPLITS)), axis=0)
        region0 = buf_ptr + row.to(tl.int64) * SPLITS * CAP
        if total >= k:
            t = tl.arange(0, SPLITS * KP)
            sp = t // KP
            j = t % KP
            valid = j < tl.load(cnt_ptr + row * SPLITS + sp)
            # unmasked: each region holds CAP >= KP entries; the unused ones are ignored
            thr, need = _threshold(_tile_keys(tl.load(region0 + sp * CAP + j), valid), k)
            base_gt = total * 0
            base_eq = total * 0
            for q in tl.static_range(SPLITS):
                base_gt, base_eq = _emit(region0 + q * CAP, tl.load(cnt_ptr + row * SPLITS + q),
                                         thr, need, base_gt, base_eq, out_row, False, CH, E, ASM)
        else:  # the sampled bound was too high (rare): this row alone, unbounded
            x_row = x_ptr + row.to(tl.int64) * ((stride_xm // ALIGN) * ALIGN)  # == stride_xm (host checks stride % ALIGN == 0); tells the compiler it is a multiple of ALIGN
            n = _stream(x_row, s, e, s, tl.full([], float("-inf"), tl.float32), tl.full([], 1, tl.int32),
                        region0, k, CAP, BLOCK, CH, E, ALIGN, PREFETCH, ASM)
            _compact(region0, n, k, out_row, CAP, False, CH, E, ASM)
        if SLOTS:
            _slots_pass(out_row, k, KP, bt_row, stride_btb, max_blocks, BS)


# ----------------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopKConfig:
    """Launch parameters (defaults chosen on an H200; the result never depends on them).

    Fused path (one persistent program per row at a time): ``block`` values per streaming
    step, ``num_warps``, ``programs_per_sm``. Split path (few rows, each cut into ``splits``
    slices + a merge): ``split_block``, ``split_warps``, ``merge_warps``. Both: ``cap``
    candidate-buffer entries per program (0: the next power of two >= k + block; on the fused
    path at least min(next power of two >= 2k + block, 8192)), ``prefetch`` blocks in flight
    ahead of the one processed (1 to 4),
    ``sample_groups`` runs of 8 sampled values, ``chunk`` entries per output pass, ``row``
    values per row of the [block / row, row] tiles, ``splits`` (0: automatic, 1: fused),
    ``maxnreg`` (register cap passed to ptxas for the fused kernel, None: none; 64 lets 8 programs of
    4 warps share an SM, at the price of a few spills outside the streaming loop), ``ptx`` (scatter stores as inline PTX
    where the kernels are compiled for CUDA; False: plain ``tl.store``).
    """

    block: int = 1024
    num_warps: int = 4
    programs_per_sm: int = 32
    split_block: int = 2048
    split_warps: int = 8
    merge_warps: int = 8
    splits: int = 0
    cap: int = 0
    sample_groups: int = 256
    chunk: int = 2048
    row: int = 16
    maxnreg: int | None = 64
    prefetch: int = 1
    ptx: bool = True


DEFAULT_CONFIG = TopKConfig()


def _num_sms(device: torch.device) -> int:
    return num_sms(device) or 4  # CPU interpreter: small grids


def _alignment(logits: torch.Tensor) -> int:
    """4 (16-byte vector loads) when every row starts 16-byte aligned and the storage holds each
    row's width rounded up to 4 values (e.g. a row stride padded to a multiple of 4, as the
    indexer-logits functions allocate), else 1. Depends on the allocation, not on N, so a stream
    of calls with varying widths uses one compiled variant."""
    M, N = logits.shape
    if logits.data_ptr() % 16 or logits.stride(0) % 4:
        return 1
    need = (logits.storage_offset() + (M - 1) * logits.stride(0) + cdiv(N, 4) * 4) * logits.element_size()
    return 4 if need <= logits.untyped_storage().nbytes() else 1


def _auto_splits(M: int, N: int, kp: int, sms: int) -> int:
    """Slices per row for few rows: 4 at most (the merge's cost grows with the slice count: on the
    H200, with the rows resident in L2, 64 x 131072 took 84 / 47 / 65 us with 2 / 4 / 8 slices),
    each slice at least 8192 values."""
    if M >= sms:
        return 1
    want = next_power_of_2(cdiv(sms, max(M, 1)))  # about one program per SM
    cap_n = max(N // 8192, 1)
    cap_merge = max(_MAX_MERGE_TILE // kp, 1)
    s = min(want, cap_n, cap_merge, 4)
    s = 1 << (s.bit_length() - 1)  # power of two, rounded down
    return max(s, 1)


def top_k_indices_launch(
    logits: torch.Tensor,
    k: int,
    out: torch.Tensor,
    *,
    mode: int,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    next_n: int = 1,
    block_table: torch.Tensor | None = None,
    block_size: int = 1,
    config: TopKConfig | None = None,
) -> torch.Tensor:
    """Launch the top-k kernels (inputs already validated). mode 0: explicit ranges,
    1: decode with 1-D seq_lens, 2: decode with 2-D seq_lens. Writes ``out`` [M, k] int32:
    positions, or with ``block_table`` (decode modes) their global cache slots."""
    cfg = config or DEFAULT_CONFIG
    M, N = logits.shape
    if M == 0:
        return out
    dev = logits.device
    kp = next_power_of_2(k)
    sms = _num_sms(dev)
    splits = cfg.splits or _auto_splits(M, N, kp, sms)
    if splits & (splits - 1):
        raise ValueError(f"config.splits: expected a power of two, got {splits}")
    block = cfg.block if splits == 1 else cfg.split_block
    cap = cfg.cap or next_power_of_2(k + block)
    if splits == 1 and not cfg.cap:  # room for ~k more candidates between cuts (up to 8192 entries)
        cap = max(cap, min(next_power_of_2(2 * k + block), 8192))
    if cap < k + block:
        raise ValueError(f"config.cap: expected >= k + block = {k + block}, got {cap}")
    ch = min(cfg.chunk, cap)
    align = _alignment(logits)
    if mode == 0:
        starts, ends, seq, seq_stride = row_starts, row_ends, row_starts, 0
    else:
        starts = ends = seq = seq_lens
        seq_stride = seq_lens.stride(0) if seq_lens.dim() == 2 else 1
    extra = nvidia_options(dev, maxnreg=cfg.maxnreg if splits == 1 else None)
    common = (logits, logits.stride(0), N, starts, ends, seq, seq_stride, next_n, k)
    consts = dict(BLOCK=block, CAP=cap, CH=ch, E=cfg.row, ALIGN=align, PREFETCH=cfg.prefetch,
                  ASM=cfg.ptx and compiled_nvidia(dev), num_stages=1, **extra)
    slots = block_table is not None
    table = (block_table, *block_table.stride(), block_table.shape[1]) if slots else (out, 0, 0, 0)  # (else unused)
    tconsts = dict(SLOTS=slots, BS=int(block_size) if slots else 1)
    if splits == 1:
        nprog = min(M, sms * cfg.programs_per_sm)
        buf = torch.empty(nprog * cap, dtype=torch.int64, device=dev)
        _topk_fused_kernel[(nprog,)](
            logits, logits.stride(0), M, N, starts, ends, seq, seq_stride, next_n, k,
            out, out.stride(0), buf, *table,
            MODE=mode, GROUPS=cfg.sample_groups, KP=kp, num_warps=cfg.num_warps, **consts, **tconsts,
        )
    else:
        buf = torch.empty(M * splits * cap, dtype=torch.int64, device=dev)
        cnt = torch.empty(M * splits, dtype=torch.int32, device=dev)
        _topk_split_kernel[(M, splits)](
            *common, buf, cnt,
            MODE=mode, SPLITS=splits, GROUPS=cfg.sample_groups, num_warps=cfg.split_warps, **consts,
        )
        _topk_merge_kernel[(M,)](
            *common, out, out.stride(0), buf, cnt, *table,
            MODE=mode, SPLITS=splits, KP=kp, num_warps=cfg.merge_warps, **consts, **tconsts,
        )
    return out


def sample_positions(length: int, groups: int = DEFAULT_CONFIG.sample_groups) -> list[int]:
    """Positions (relative to the row start) that the sampled bound reads (for tests)."""
    stride = max(length // groups, _RUN)
    return [g * stride + j for g in range(groups) for j in range(_RUN) if g * stride + j < length]
