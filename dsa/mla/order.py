"""Index lists grouped by cache slot before a many-token sparse-MLA call (an L2-locality pre-pass).

The attention of a token is a sum over the *set* of its valid entries, so their order is free. Grouping each
row's entries by slot range makes the programs that run side by side (one token each, started together) walk
the cache from low slots to high ones in step: a row gathered by one program is still in L2 when its
neighbours want it. Inside a tile of 64 rows the order does not matter, so a few ranges give what a full sort
gives. Measured on the H200 (BENCHMARKS.md, fifteenth session; bf16 prefill, 4096 tokens, 2048 random slots of
128K, 4 ranges, this kernel's 42 us included): h_q 16 -11.4%, h_q 32 -8.5%, h_q 128 unchanged; a full sort
(``torch.sort`` 262 us, ``tl.sort`` 566 us) costs more than it saves.

Row ``t`` of the result is a stable partition of ``indices[t]``: its valid entries (``0 <= idx < S`` and, with
``topk_length``, position ``< topk_length[t]``) grouped by slot range, lower ranges first (higher first in the rows
of odd waves with :func:`order_indices`' ``wave``): the range of ``idx`` is ``(idx - min) >> shift`` with ``min`` /
``max`` the row's smallest / largest valid slot and ``shift`` the smallest that maps ``max - min`` below ``buckets``
(a power of two), so a row spans ``buckets / 2`` to ``buckets`` ranges of ``2**shift`` slots; the original order
kept inside a range, duplicates kept; then :data:`INVALID` (``2**31 - 1``, which is ``>= S`` and therefore an
invalid slot to the attention kernels) in every other position. The valid entries stay within the first
``topk_length[t]`` positions, so the same ``topk_length`` still applies.

The kernel ranks each entry inside its range with packed counters: ``63 // BITS`` ranges share one int64
whose ``BITS``-wide fields count them, so one prefix sum per word ranks every entry of those ranges, and the
word's total, shifted onto itself, gives each range's start (4 ranges and the invalid entries: one word). The
prefix sum is most of its time: a plain copy of the same bytes takes 22 us.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import next_power_of_2
from ..constants import INT32_MAX
from .reference import valid_mask

INVALID = INT32_MAX
_INVALID = tl.constexpr(INVALID)
#: longest row one program partitions
MAX_ORDER_TOPK = 8192
#: slot ranges per row, at most (measured on the H200, BENCHMARKS.md fifteenth session)
DEFAULT_BUCKETS = 4


@triton.jit(do_not_specialize=["S", "topk", "wave", "groups"])
def _order_rows_kernel(idx_ptr, stride_idx, len_ptr, out_ptr, skip_ptr, S, topk, wave, groups, HAS_LEN: tl.constexpr,
                       BLOCK: tl.constexpr, LOG2_NB: tl.constexpr, BITS: tl.constexpr, SKIP: tl.constexpr = -1):
    if SKIP >= 0:  # (lists for a launch that a flag on the device skips: see order_indices' ``skip``)
        if tl.load(skip_ptr) == SKIP:
            return
    NB: tl.constexpr = 1 << LOG2_NB
    PER: tl.constexpr = 63 // BITS  # buckets per int64 word
    WORDS: tl.constexpr = (NB + PER) // PER  # NB valid buckets + the invalid one
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inb = offs < topk
    x = tl.load(idx_ptr + t * stride_idx + offs, mask=inb, other=-1)
    ok = inb & (x >= 0) & (x < S)
    if HAS_LEN:
        ok = ok & (offs < tl.load(len_ptr + t))
    lo = tl.min(tl.where(ok, x, _INVALID), axis=0)
    hi = tl.max(tl.where(ok, x, -1), axis=0)
    top = tl.maximum(hi - lo, 0)  # 0 <= idx - min <= top for every valid idx
    shift = 0
    for s in tl.static_range(31 - LOG2_NB):
        shift += ((top >> (s + LOG2_NB)) > 0).to(tl.int32)
    b = tl.where(ok, (x - lo) >> shift, NB)  # out-of-block lanes: NB too
    if wave > 0:  # rows whose first program runs in an odd wave: the ranges from the top down
        if ((t * groups) // wave) % 2 == 1:
            b = tl.where(ok, NB - 1 - b, b)
    mask_f = (1 << BITS) - 1
    pos = tl.zeros([BLOCK], dtype=tl.int32)
    base = 0
    for w in tl.static_range(WORDS):
        f = b - w * PER  # field of this word, when 0 <= f < PER
        inw = inb & (f >= 0) & (f < PER)
        sh = tl.where(inw, f * BITS, 0).to(tl.int64)
        one = tl.where(inw, tl.full([BLOCK], 1, tl.int64) << sh, 0)
        incl = tl.cumsum(one, axis=0)
        total = tl.sum(one, axis=0)
        starts = total * 0  # field j: entries of this word's buckets below j
        for m in tl.static_range(1, PER):
            starts += total << (m * BITS)
        rank = (incl >> sh) & mask_f  # 1-based rank inside the bucket
        start = (starts >> sh) & mask_f
        pos = tl.where(inw, base + start + rank - 1, pos)
        base += tl.sum(inw.to(tl.int32), axis=0)
    tl.store(out_ptr + t * topk + pos, tl.where(ok, x, _INVALID), mask=inb)


def order_indices(indices: torch.Tensor, S: int, topk_length: torch.Tensor | None = None,
                  buckets: int = DEFAULT_BUCKETS, out: torch.Tensor | None = None, wave: int = 0,
                  groups: int = 1, skip: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """``[T, topk]`` int32 index lists (any row stride, last dim contiguous) -> a contiguous ``[T, topk]`` int32
    tensor (``out`` if given, else a new one): each row's valid slots grouped by range (module docstring), then
    :data:`INVALID`. ``topk <= MAX_ORDER_TOPK``, ``buckets`` a power of two from 1 to 32. One launch, no host
    synchronisation.

    ``wave`` (serpentine order; 0: off): the attention call's programs resident at once, ``groups`` its programs per
    row (head groups). Rows whose first program ``t * groups`` falls in an odd wave (``(t * groups) // wave`` odd)
    take their ranges from the top down, so that the programs starting as a wave ends walk the slots that the ending
    ones read last, which are still in L2, instead of the lowest slots, which were read a wave ago.

    ``skip = (flag, value)`` (``flag`` ``[1]`` int32 on the device): where ``flag`` holds ``value`` the kernel writes
    nothing (the lists of an attention launch that the same flag skips)."""
    T, topk = indices.shape
    if topk > MAX_ORDER_TOPK:
        raise ValueError(f"order_indices: topk {topk} > {MAX_ORDER_TOPK}")
    if buckets not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"order_indices: buckets {buckets} is not a power of two from 1 to 32")
    if wave < 0 or groups < 1:
        raise ValueError(f"order_indices: wave {wave} must be >= 0 and groups {groups} >= 1")
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=indices.device)
    elif out.shape != (T, topk) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"order_indices: out must be a contiguous int32 [{T}, {topk}] tensor, got "
                         f"{out.dtype} {list(out.shape)}")
    if T == 0:
        return out
    block = next_power_of_2(topk)
    has_len = topk_length is not None
    _order_rows_kernel[(T,)](indices, indices.stride(0), topk_length if has_len else indices, out,
                             out if skip is None else skip[0], S, topk, int(wave), int(groups), HAS_LEN=has_len,
                             BLOCK=block, LOG2_NB=buckets.bit_length() - 1, BITS=block.bit_length(),
                             SKIP=-1 if skip is None else int(skip[1]), num_warps=4 if block <= 2048 else 8)
    return out


def order_indices_ref(indices: torch.Tensor, S: int, topk_length: torch.Tensor | None = None,
                      buckets: int = DEFAULT_BUCKETS, wave: int = 0, groups: int = 1) -> torch.Tensor:
    """Plain PyTorch form of :func:`order_indices` (the test oracle)."""
    x = indices.long()
    ok = valid_mask(x, S, topk_length)
    lo = torch.where(ok, x, INVALID).min(dim=1, keepdim=True).values
    hi = torch.where(ok, x, -1).max(dim=1, keepdim=True).values
    top = (hi - lo).clamp(min=0)
    log2_nb = buckets.bit_length() - 1
    shift = sum(((top >> (s + log2_nb)) > 0).long() for s in range(31 - log2_nb))
    b = torch.where(ok, (x - lo) >> shift, buckets)
    if wave > 0:
        odd = ((torch.arange(x.shape[0], device=x.device) * groups) // wave % 2 == 1)[:, None]
        b = torch.where(ok & odd, buckets - 1 - b, b)
    perm = torch.sort(b, dim=1, stable=True).indices
    return torch.where(ok, x, INVALID).gather(1, perm).to(torch.int32).contiguous()
