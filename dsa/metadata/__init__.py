"""Index conversion and ragged metadata (SPEC.md "Index conversion and ragged metadata").

* :func:`convert_req_index_to_global_index`: per-request top-k token positions ->
  global cache slots through the block table (dense ``[T, K]`` or packed CSR).
* :func:`generate_sparse_seqlen`: per query token, how many keys its top-k
  selection holds (``min(L - q + i + 1, topk)``); its cumulative sum is the
  CSR ``indptr`` of the packed form.
"""
from __future__ import annotations

import torch

from .. import _checks, _replay
from ..backend import resolve
from .reference import convert_req_index_to_global_index_ref, generate_sparse_seqlen_ref

__all__ = [
    "convert_req_index_to_global_index",
    "generate_sparse_seqlen",
    "convert_req_index_to_global_index_ref",
    "generate_sparse_seqlen_ref",
]


@_replay.planned
def convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    *,
    return_valid_counts: bool = False,
    indptr: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    valid_counts_out: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Map per-request top-k token positions to global paged-cache slots.

    Args:
        req_id: ``[T]`` int32, the request of each query token (row of ``block_table``).
        block_table: ``[R, max_blocks]`` int32 (any strides), physical block ids; negative = unallocated.
        token_indices: ``[T, K]`` int32 (last dim contiguous), top-k positions inside the
            request's sequence; negative = no entry.
        block_size: ``B``, a power of two from 1 to 256.
        return_valid_counts: also return ``valid_counts [T]`` int32.
        indptr: ``[T+1]`` int32; selects the packed CSR form (below).
        out: optional output: ``[T, K]`` int32 (last dim contiguous) in the dense form, a 1-D
            contiguous int32 tensor in the CSR form.
        valid_counts_out: optional ``[T]`` int32 contiguous buffer for the counts (it is zeroed
            and filled; implies ``return_valid_counts``).
        backend: ``None | "auto" | "triton" | "reference"`` (see :mod:`dsa.backend`).

    Dense form: ``out[t, c] = block_table[req_id[t], idx // B] * B + idx % B`` with
    ``idx = token_indices[t, c]``, and ``-1`` where ``idx < 0``, ``idx // B >= max_blocks``, the
    block-table entry is negative, ``req_id[t]`` is outside ``[0, R)``, or the slot does not fit
    in int32 (the slot is computed in 64 bits and never wraps: the int32 output limits the cache
    to ``num_slots < 2**31``).

    CSR form (``indptr`` given): row ``t`` keeps its first ``n_t = indptr[t+1] - indptr[t]``
    entries (``n_t <= K`` is the caller's contract; columns past ``K`` are not written, and no
    write ever lands outside ``out``), converted as above and packed at
    ``out[indptr[t] : indptr[t] + n_t]``. **Invalid entries stay -1** in the packed form too
    (vLLM's ROCm kernel writes 0 there, silently aliasing slot 0). When ``out`` is None its size
    is ``indptr[-1].item()``: a host-device sync; pass ``out`` (e.g. sized ``T * K``) to avoid it.

    ``valid_counts[t]`` counts the valid entries of row t (all K columns in the dense form,
    the first ``min(n_t, K)`` in the CSR form).

    Returns ``out``, or ``(out, valid_counts)`` when ``return_valid_counts`` (or
    ``valid_counts_out``) is given. No sync except the CSR-without-``out`` case above;
    CUDA-graph safe for fixed shapes when ``out`` (and ``valid_counts_out``) are passed.
    """
    _checks.check_tensor("req_id", req_id, dtype=torch.int32, ndim=1)
    _checks.check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=False)
    _checks.check_tensor("token_indices", token_indices, dtype=torch.int32, ndim=2)
    T, K = token_indices.shape
    _checks.check_dim("req_id", req_id.shape[0], T, "length (token_indices.shape[0])")
    _checks.check_block_size("block_size", block_size)
    if not isinstance(return_valid_counts, bool):
        raise TypeError(f"return_valid_counts: expected a bool, got {type(return_valid_counts).__name__}")
    if indptr is not None:
        _checks.check_tensor("indptr", indptr, dtype=torch.int32, shape=(T + 1,), contiguous=True)
        if out is not None:
            _checks.check_tensor("out", out, dtype=torch.int32, ndim=1, contiguous=True)
    elif out is not None:
        _checks.check_tensor("out", out, dtype=torch.int32, shape=(T, K))
    if valid_counts_out is not None:
        _checks.check_tensor("valid_counts_out", valid_counts_out, dtype=torch.int32, shape=(T,), contiguous=True)
        return_valid_counts = True
    device = _checks.check_same_device(
        token_indices=token_indices,
        req_id=req_id,
        block_table=block_table,
        indptr=indptr,
        out=out,
        valid_counts_out=valid_counts_out,
    )

    if resolve(backend, device) == "reference":
        res = convert_req_index_to_global_index_ref(
            req_id, block_table, token_indices, block_size,
            return_valid_counts=return_valid_counts, indptr=indptr, out=out,
        )
        if valid_counts_out is not None:
            valid_counts_out.copy_(res[1])
            return res[0], valid_counts_out
        return res

    from .kernel import convert_req_index_to_global_index_triton

    if out is None:
        if indptr is None:
            out = torch.empty((T, K), dtype=torch.int32, device=device)
        else:
            out = torch.empty(int(indptr[-1].item()), dtype=torch.int32, device=device)  # host sync
    counts = None
    if return_valid_counts:
        counts = valid_counts_out if valid_counts_out is not None else torch.empty(T, dtype=torch.int32, device=device)
        counts.zero_()
    convert_req_index_to_global_index_triton(req_id, block_table, token_indices, block_size, out, indptr, counts)
    return (out, counts) if return_valid_counts else out


@_replay.planned
def generate_sparse_seqlen(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    *,
    num_tokens: int | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Per query token, the number of keys its sparse (top-k) attention sees.

    Args:
        query_start_loc: ``[R+1]`` int32, non-decreasing cumulative query lengths (``[0] == 0``
            normally; tokens before it get 0).
        seq_lens: ``[R]`` int32, each request's context length including its new tokens.
        topk: positive int, the top-k width (e.g. 2048).
        num_tokens: T, the output length (tokens ``>= query_start_loc[R]``, e.g. CUDA-graph
            padding, get 0).
        out: optional ``[T]`` int32 contiguous output (fixes T; must agree with ``num_tokens``).
        backend: ``None | "auto" | "triton" | "reference"``.

    For token ``i`` (0-based inside request ``r``, ``q = query_start_loc[r+1] - query_start_loc[r]``,
    ``L = seq_lens[r]``): ``max(0, min(L - q + i + 1, topk))`` (0 when ``L == 0``). Computed in 64 bits.

    Returns ``[T]`` int32. T comes from ``out``, else ``num_tokens``, else
    ``query_start_loc[-1].item()`` — a host-device sync; pass ``num_tokens`` or ``out`` to avoid
    it (and to be CUDA-graph safe).
    """
    _checks.check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, contiguous=True)
    _checks.check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, contiguous=True)
    R = seq_lens.shape[0]
    _checks.check_dim("query_start_loc", query_start_loc.shape[0], R + 1, "length (seq_lens.shape[0] + 1)")
    _checks.check_positive_int("topk", topk)
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
        raise ValueError(f"num_tokens: expected a non-negative int, got {num_tokens!r}")
    if out is not None:
        _checks.check_tensor("out", out, dtype=torch.int32, ndim=1, contiguous=True)
        if num_tokens is not None:
            _checks.check_dim("out", out.shape[0], num_tokens, "length (num_tokens)")
    device = _checks.check_same_device(query_start_loc=query_start_loc, seq_lens=seq_lens, out=out)

    if resolve(backend, device) == "reference":
        return generate_sparse_seqlen_ref(query_start_loc, seq_lens, topk, num_tokens=num_tokens, out=out)

    from .kernel import generate_sparse_seqlen_triton

    if out is None:
        T = num_tokens if num_tokens is not None else int(query_start_loc[-1].item())  # sync without num_tokens
        out = torch.empty(T, dtype=torch.int32, device=device)
    generate_sparse_seqlen_triton(query_start_loc, seq_lens, topk, out)
    return out
