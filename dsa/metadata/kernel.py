"""Triton kernels for index conversion and ragged metadata, and their launch code.

``_convert_req_index_kernel``: grid ``(T, cdiv(K, BLOCK_N))``, one program per
token x tile of top-k columns. The program reads its token's request id once,
loads ``BLOCK_N`` top-k indices, looks their blocks up in the request's row of
the block table (masked: no load for invalid indices) and writes the global
slots (dense row, or packed at ``indptr[t]`` in the CSR form). The slot
``entry * BLOCK_SIZE + offset`` is computed in int64 and marked invalid (-1)
when it does not fit the int32 output. Valid counts: each program adds its
tile's count to a zeroed int32 counter with ``tl.atomic_add`` (integer adds:
the result does not depend on the order, so it is deterministic).

``_sparse_seqlen_kernel``: grid ``(cdiv(T, BLOCK_T),)``; each program takes a
tile of tokens and finds each token's request by a branch-free binary search
over ``query_start_loc`` (``ceil(log2(R+1))`` steps, unrolled). This needs no
maximum query length from the host (which would cost a sync), balances long
prefills and decode tokens alike, and writes every output element (tokens past
``query_start_loc[R]``, e.g. CUDA-graph padding, get 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from ..backend import interpreter_on


@triton.jit
def global_slot(idx, bt_row, bt_stride1, max_blocks, ok, BLOCK_SIZE: tl.constexpr):
    """Global cache slots of request-relative positions ``idx`` through the request's block-table row ``bt_row``:
    ``bt_row[idx // BLOCK_SIZE] * BLOCK_SIZE + idx % BLOCK_SIZE``, computed in int64. Returns ``(slot int32,
    valid)``; the slot is -1 where ``ok`` is false, ``idx < 0``, the block is past ``max_blocks``, its entry is
    negative or the slot does not fit in int32 (no load there). Shared by the conversion kernel and the top-k
    kernels' slot output, so both apply exactly these rules."""
    # idx >= 0 wherever it is used, so // and % are plain shifts and masks here
    blk = idx // BLOCK_SIZE
    in_table = ok & (idx >= 0) & (blk < max_blocks)
    entry = tl.load(bt_row + blk.to(tl.int64) * bt_stride1, mask=in_table, other=-1)
    slot = entry.to(tl.int64) * BLOCK_SIZE + idx % BLOCK_SIZE
    valid = in_table & (entry >= 0) & (slot <= 2147483647)
    return tl.where(valid, slot, -1).to(tl.int32), valid


@triton.jit(do_not_specialize=["max_blocks", "num_reqs", "out_numel", "bt_stride0"])
def _convert_req_index_kernel(
    req_id_ptr,  # int32 [T]
    bt_ptr,  # int32 [R, max_blocks] (strided)
    ti_ptr,  # int32 [T, K] (strided)
    indptr_ptr,  # int32 [T + 1] (CSR only)
    out_ptr,  # int32 [T, K] (dense, row stride out_stride0) or [out_numel] (CSR)
    cnt_ptr,  # int32 [T], zeroed (COUNT only)
    K,
    max_blocks,
    num_reqs,
    out_numel,
    bt_stride0,
    bt_stride1,
    ti_stride0,
    ti_stride1,
    out_stride0,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CSR: tl.constexpr,
    COUNT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)

    if CSR:
        start = tl.load(indptr_ptr + t).to(tl.int64)
        n = tl.load(indptr_ptr + t + 1).to(tl.int64) - start
        n = tl.minimum(n, K)
        if tile * BLOCK_N >= n:
            return  # nothing of this row lives in this tile
        col_mask = cols < n
        dst = start + cols
        store_mask = col_mask & (dst >= 0) & (dst < out_numel)
    else:
        col_mask = cols < K
        dst = t * out_stride0 + cols
        store_mask = col_mask

    req = tl.load(req_id_ptr + t)
    req_ok = (req >= 0) & (req < num_reqs)
    idx = tl.load(ti_ptr + t * ti_stride0 + cols.to(tl.int64) * ti_stride1, mask=col_mask, other=-1)
    res, valid = global_slot(idx, bt_ptr + req.to(tl.int64) * bt_stride0, bt_stride1, max_blocks, col_mask & req_ok,
                             BLOCK_SIZE)
    tl.store(out_ptr + dst, res, mask=store_mask)
    if COUNT:
        # relaxed: a plain integer count needs no ordering (the default acq_rel fences would make
        # every program wait for its own stores to become visible)
        tl.atomic_add(cnt_ptr + t, tl.sum(valid.to(tl.int32), axis=0), sem="relaxed")


def _default_block_n(K: int) -> int:
    # Interpreter: few, wide programs (numpy cost is per op). GPU: 512 columns per program,
    # 4 warps -> 4 int32 per thread per load, K=2048 gives 4 programs per token.
    cap = 1024 if interpreter_on() else 512
    return max(16, min(cap, next_power_of_2(max(K, 1))))


def convert_req_index_to_global_index_triton(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    indptr: torch.Tensor | None,
    counts: torch.Tensor | None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> None:
    """Launch the conversion kernel. Arguments are validated by the wrapper; ``counts``
    (when given) must be zeroed by the caller."""
    T, K = token_indices.shape
    R, max_blocks = block_table.shape
    if T == 0 or K == 0:
        return
    BLOCK_N = block_n or _default_block_n(K)
    csr = indptr is not None
    grid = (T, cdiv(K, BLOCK_N))
    _convert_req_index_kernel[grid](
        req_id,
        block_table,
        token_indices,
        indptr if csr else req_id,  # dummy pointer when unused
        out,
        counts if counts is not None else req_id,
        K,
        max_blocks,
        R,
        out.numel(),
        block_table.stride(0),
        block_table.stride(1),
        token_indices.stride(0),
        token_indices.stride(1),
        out.stride(0) if not csr else 0,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        CSR=csr,
        COUNT=counts is not None,
        num_warps=num_warps,
    )


@triton.jit(do_not_specialize=["T", "R"])
def _sparse_seqlen_kernel(
    qsl_ptr,  # int32 [R + 1]
    seq_lens_ptr,  # int32 [R]
    out_ptr,  # int32 [T]
    T,
    R,
    topk,
    BLOCK_T: tl.constexpr,
    LOG_STEPS: tl.constexpr,  # ceil(log2(R + 1)), >= 1
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    # largest r in [0, R] with query_start_loc[r] <= t (binary search, unrolled)
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    for s in tl.static_range(LOG_STEPS):
        cand = lo + (1 << (LOG_STEPS - 1 - s))
        ok = tmask & (cand <= R)
        v = tl.load(qsl_ptr + cand, mask=ok, other=0)
        lo = tl.where(ok & (v.to(tl.int64) <= t), cand, lo)
    first = tl.load(qsl_ptr)
    total = tl.load(qsl_ptr + R)
    inside = tmask & (lo < R) & (t >= first) & (t < total)
    start = tl.load(qsl_ptr + lo, mask=inside, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + lo + 1, mask=inside, other=0).to(tl.int64)
    L = tl.load(seq_lens_ptr + lo, mask=inside, other=0).to(tl.int64)
    val = L - (end - start) + (t - start) + 1
    val = tl.minimum(val, topk)
    val = tl.maximum(val, 0)
    val = tl.where(inside, val, 0)
    tl.store(out_ptr + t, val.to(tl.int32), mask=tmask)


def generate_sparse_seqlen_triton(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    out: torch.Tensor,
    block_t: int | None = None,
) -> None:
    T = out.numel()
    if T == 0:
        return
    R = seq_lens.shape[0]
    BLOCK_T = block_t or (max(16, min(1024, next_power_of_2(T))))
    log_steps = max(1, int(R).bit_length())  # 2**log_steps > R
    grid = (cdiv(T, BLOCK_T),)
    _sparse_seqlen_kernel[grid](
        query_start_loc, seq_lens, out, T, R, topk, BLOCK_T=BLOCK_T, LOG_STEPS=log_steps, num_warps=4
    )
