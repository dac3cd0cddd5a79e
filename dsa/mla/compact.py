"""A bf16 copy of only the pages of an fp8_ds_mla cache that a call reads, and its index lists remapped onto it.

Many-token calls over the fp8_ds_mla cache with more than 16 heads run faster on a bf16 copy of the cache (see
:data:`dsa.mla.kernel.DEQUANT_FIRST_MIN_RATIO`). An engine's cache is a pool of pages shared by every request, often
millions of rows, while one prefill reads the few pages of its own requests' contexts. So the copy holds just those:

1. :func:`mark_pages`: one pass over the index lists marks every page of :data:`PAGE_ROWS` rows that holds a valid
   entry (``0 <= idx < S`` and ``j < topk_length[t]``);
2. the marked pages get consecutive places in the copy (a prefix sum) and are listed in order; their number stays
   on the device, where a flag says whether the copy is taken: at least one page, and no more than the caller's
   bound on the copy's rows (which is its size);
3. :func:`remap_indices`: every valid entry ``idx`` becomes ``place[idx // PAGE_ROWS] * PAGE_ROWS + idx %
   PAGE_ROWS``, every other entry ``-1``;
4. :func:`dsa.mla_cache.kernel.fp8_ds_mla_read` dequantises the listed pages into the copy where it is taken, reading
   their number on the device.

Nothing is read back to the host: the caller queues its kernels over the copy and over the cache, each skipping
itself by the flag (:func:`dsa.mla.kernel.sparse_mla_triton`'s ``skip``). Rows of the copy past the cache's end (its
last page cut short) are 0; every other row holds its slot's values as :func:`dsa.dequantize_fp8_ds_mla` gives them,
NaN included, so the call over the copy attends over the same bf16 values, and the rows it reads are the same.
:func:`compact_ref` is the PyTorch reference of the whole.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from ..constants import D_QK, FP8_DS_MLA_ROW_BYTES
from .reference import valid_mask

#: rows per page of the copy (a power of two; the cache's own block size does not matter: every view is flat here)
PAGE_ROWS = 64
#: int32 words between two pages' flags in :func:`mark_pages`' buffer: one flag per 128-byte line (side by side, the
#: flags of a context's few hundred pages share a few lines, and the stores to them queue up in L2 one after another)
FLAG_STRIDE = 32
_BLOCK = 1024  # index-list entries per program (the remap kernel) and pages per program (listing them)
#: tokens per program, entries per step and warps marking the pages (``benchmarks/sweep_mark_pages.py``, H100,
#: fifty-sixth session: 4096 tokens over 16K / 128K rows of a 2M-row pool 78.8 / 82.0 µs at 8, 256, 4 -> 47.7 / 61.4;
#: 1024 tokens over 128K 58.0 -> 30.0; the fastest of 40 shapes or within 1.2 µs of it)
_MARK_TOKENS, _MARK_BLOCK, _MARK_WARPS = 2, 256, 8


@triton.jit(do_not_specialize=["T", "n_slots"])  # (T and S change from call to call: one variant for all)
def _mark_pages_kernel(idx_ptr, len_ptr, flag_ptr, T, topk, stride_t, n_slots, HAS_LEN: tl.constexpr,
                       SHIFT: tl.constexpr, STRIDE: tl.constexpr, TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    # (each program walks the lists of TOKENS tokens, BLOCK entries at a time, and an entry stores its page's flag
    # only if it finds it unset: after a program's first steps its pages are mostly marked, so the stores, which
    # queue up in L2 where many go to one word, are few)
    for tt in range(TOKENS):
        t = tl.program_id(0) * TOKENS + tt
        n = topk
        if HAS_LEN:
            n = tl.minimum(tl.load(len_ptr + t, mask=t < T, other=0), topk)
        n = tl.where(t < T, n, 0)
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            live = j < n
            i = tl.load(idx_ptr + t.to(tl.int64) * stride_t + j, mask=live, other=-1)
            ok = live & (i >= 0) & (i < n_slots)
            at = flag_ptr + (i >> SHIFT).to(tl.int64) * STRIDE
            seen = tl.load(at, mask=ok, other=1)
            tl.store(at, tl.full([BLOCK], 1, tl.int32), mask=ok & (seen == 0))


@triton.jit(do_not_specialize=["n_pages", "max_pages"])
def _list_pages_kernel(flag_ptr, end_ptr, list_ptr, taken_ptr, n_pages, max_pages, STRIDE: tl.constexpr,
                       BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = p < n_pages
    marked = tl.load(flag_ptr + p.to(tl.int64) * STRIDE, mask=inb, other=0) != 0
    end = tl.load(end_ptr + p, mask=inb, other=0)
    tl.store(list_ptr + end - 1, p, mask=marked)
    if tl.program_id(0) == 0:  # the copy is taken where it holds at least one page, and no more than max_pages
        count = tl.load(end_ptr + n_pages - 1)
        tl.store(taken_ptr, ((count > 0) & (count <= max_pages)).to(tl.int32))


@triton.jit(do_not_specialize=["n_slots"])
def _remap_kernel(idx_ptr, len_ptr, end_ptr, out_ptr, topk, stride_t, stride_out, n_slots,
                  HAS_LEN: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = j < topk
    n = topk
    if HAS_LEN:
        n = tl.minimum(tl.load(len_ptr + t), topk)
    i = tl.load(idx_ptr + t.to(tl.int64) * stride_t + j, mask=inb, other=-1)
    ok = inb & (j < n) & (i >= 0) & (i < n_slots)
    place = tl.load(end_ptr + (i >> SHIFT), mask=ok, other=1) - 1
    new = tl.where(ok, (place << SHIFT) + (i & ((1 << SHIFT) - 1)), -1)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + j, new, mask=inb)


def _shift() -> int:
    shift = PAGE_ROWS.bit_length() - 1
    assert 1 << shift == PAGE_ROWS
    return shift


def mark_pages(indices: torch.Tensor, topk_length: torch.Tensor | None, n_slots: int) -> torch.Tensor:
    """``[ceil(n_slots / PAGE_ROWS)]`` int32 (a view of stride :data:`FLAG_STRIDE`): 1 for each page holding a valid
    entry of ``indices [T, topk]`` int32 (``0 <= idx < n_slots`` and ``j < topk_length[t]``), else 0."""
    T, topk = indices.shape
    flags = torch.zeros(cdiv(n_slots, PAGE_ROWS) * FLAG_STRIDE, dtype=torch.int32, device=indices.device)
    if T and topk:
        lens = indices if topk_length is None else topk_length
        _mark_pages_kernel[(cdiv(T, _MARK_TOKENS),)](indices, lens, flags, T, topk, indices.stride(0), n_slots,
                                                     HAS_LEN=topk_length is not None, SHIFT=_shift(),
                                                     STRIDE=FLAG_STRIDE, TOKENS=_MARK_TOKENS, BLOCK=_MARK_BLOCK,
                                                     num_warps=_MARK_WARPS)
    return flags[::FLAG_STRIDE]


def remap_indices(indices: torch.Tensor, topk_length: torch.Tensor | None, ends: torch.Tensor,
                  n_slots: int) -> torch.Tensor:
    """``indices [T, topk]`` int32 onto the copy: valid entries to ``place * PAGE_ROWS + idx % PAGE_ROWS``, where
    ``place = ends[idx // PAGE_ROWS] - 1`` (``ends [pages]`` int32: the running count of marked pages, contiguous), the
    rest to ``-1``."""
    T, topk = indices.shape
    out = torch.empty(T, topk, dtype=torch.int32, device=indices.device)
    if T and topk:
        lens = indices if topk_length is None else topk_length
        _remap_kernel[(T, cdiv(topk, _BLOCK))](indices, lens, ends, out, topk, indices.stride(0), out.stride(0),
                                               n_slots, HAS_LEN=topk_length is not None, SHIFT=_shift(), BLOCK=_BLOCK)
    return out


def compact(kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None, max_rows: int):
    """The bf16 copy of the pages of ``kv`` (the flat ``[S, 656]`` uint8 view of an fp8_ds_mla cache) that
    ``indices [T, topk]`` int32 (with ``topk_length [T]`` int32 or None) reads, and the lists remapped onto it, with
    no synchronisation: ``(copy [R, 576] bf16, indices [T, topk] int32, taken [1] int32)``. ``R`` is ``max_rows``
    rounded down to whole pages (at most the cache's); ``taken`` is 1 where the pages read are at least one and fit
    ``R``: then the first ``pages * PAGE_ROWS`` rows of the copy hold them (the rest unwritten), and every valid entry
    of the lists names its slot's row there, every other ``-1`` (see the module's docstring). Else ``taken`` is 0
    and the copy is unwritten (the lists are remapped all the same).
    """
    from ..mla_cache.kernel import fp8_ds_mla_read

    assert kv.dim() == 2 and kv.shape[1] == FP8_DS_MLA_ROW_BYTES and kv.dtype == torch.uint8
    S = kv.shape[0]
    indices = indices if indices.stride(1) == 1 else indices.contiguous()
    flags = mark_pages(indices, topk_length, S)
    ends = torch.cumsum(flags, 0, dtype=torch.int32).contiguous()
    n_pages = len(flags)
    max_pages = min(max(max_rows, 0) // PAGE_ROWS, n_pages)
    taken = torch.zeros(1, dtype=torch.int32, device=kv.device)
    listed = torch.empty(n_pages, dtype=torch.int32, device=kv.device)  # (the marked pages in order, then unused)
    if n_pages:
        _list_pages_kernel[(cdiv(n_pages, _BLOCK),)](flags, ends, listed, taken, n_pages, max_pages,
                                                     STRIDE=FLAG_STRIDE, BLOCK=_BLOCK)
    lists = remap_indices(indices, topk_length, ends, S)
    copy = torch.empty(max_pages * PAGE_ROWS, D_QK, dtype=torch.bfloat16, device=kv.device)
    if max_pages:
        fp8_ds_mla_read(kv, copy, pages=listed, page_rows=PAGE_ROWS, count=ends[-1:])
    return copy, lists, taken


def compact_ref(kv: torch.Tensor, indices: torch.Tensor, topk_length: torch.Tensor | None):
    """PyTorch reference of :func:`compact`: the copy of exactly the pages read, and the remapped lists."""
    from ..mla_cache.reference import dequantize_fp8_ds_mla

    S = kv.shape[0]
    idx = indices.long()
    valid = valid_mask(idx, S, topk_length)
    pages = torch.unique(idx[valid] // PAGE_ROWS)  # (sorted)
    place = torch.full((cdiv(S, PAGE_ROWS),), -1, dtype=torch.long, device=kv.device)
    place[pages] = torch.arange(len(pages), device=kv.device)
    slots = (pages[:, None] * PAGE_ROWS + torch.arange(PAGE_ROWS, device=kv.device)).flatten()
    copy = torch.zeros(len(slots), D_QK, dtype=torch.bfloat16, device=kv.device)
    inside = slots < S
    copy[inside] = dequantize_fp8_ds_mla(kv[slots[inside]])
    safe = torch.where(valid, idx, 0)
    new = torch.where(valid, place[safe // PAGE_ROWS] * PAGE_ROWS + safe % PAGE_ROWS, -1)
    return copy, new.to(torch.int32)
