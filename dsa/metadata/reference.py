"""Plain PyTorch references for the index-conversion and ragged-metadata ops.

These define the semantics (see SPEC.md "Index conversion and ragged metadata")
and are the oracle the Triton kernels are tested against. They are importable
and runnable without Triton.

Conventions shared with the kernels:

* A converted entry is ``-1`` ("invalid") when the top-k index is negative, when
  its block lies outside the block table (``idx // B >= max_blocks``), when the
  block-table entry there is negative (an unallocated block), when the token's
  request id is outside ``[0, num_requests)``, or when the slot
  ``entry * B + idx % B`` does not fit in int32 (``>= 2**31``). The slot is
  computed in int64 and never wraps onto another slot: the output dtype is
  int32, so caches of ``num_slots >= 2**31`` cannot be addressed.
* The CSR (ragged) form packs the first ``n_t = indptr[t+1] - indptr[t]``
  entries of row ``t`` at ``out[indptr[t] : indptr[t+1]]``; invalid entries
  stay ``-1`` there too. (vLLM's ROCm kernel writes 0 for them, which silently
  aliases cache slot 0; we do not.)
"""
from __future__ import annotations

import torch

from ..constants import INT32_MAX


def convert_req_index_to_global_index_ref(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    block_size: int,
    *,
    return_valid_counts: bool = False,
    indptr: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
):
    """Reference of :func:`dsa.metadata.convert_req_index_to_global_index`.

    req_id ``[T]`` int32, block_table ``[R, max_blocks]`` int32, token_indices ``[T, K]`` int32.
    Dense form: returns ``out [T, K]`` int32. CSR form (``indptr [T+1]`` int32 given): returns
    the packed 1-D int32 ``out`` of ``out.numel()`` entries (``indptr[-1]`` when ``out`` is None).
    With ``return_valid_counts`` also returns ``valid_counts [T]`` int32 (the number of valid
    entries a row contributes: over all K columns in the dense form, over its first
    ``min(n_t, K)`` in the CSR form).
    """
    T, K = token_indices.shape
    R, max_blocks = block_table.shape
    B = int(block_size)
    dev = token_indices.device

    req = req_id.long()
    req_ok = (req >= 0) & (req < R)
    idx = token_indices.long()
    blk = torch.div(idx, B, rounding_mode="floor")
    off = idx - blk * B
    in_table = (idx >= 0) & (blk < max_blocks) & req_ok[:, None]
    if max_blocks > 0 and R > 0:
        rows = block_table[req.clamp(0, R - 1)].long()  # [T, max_blocks]
        entry = torch.gather(rows, 1, blk.clamp(0, max_blocks - 1))
    else:
        entry = torch.full_like(idx, -1)
    entry = torch.where(in_table, entry, torch.full_like(entry, -1))
    slot = entry * B + off
    valid = in_table & (entry >= 0) & (slot <= INT32_MAX)
    dense = torch.where(valid, slot, torch.full_like(slot, -1)).to(torch.int32)

    if indptr is None:
        counts = valid.sum(dim=1, dtype=torch.int32) if T else torch.zeros(0, dtype=torch.int32, device=dev)
        if out is None:
            out = dense
        else:
            out.copy_(dense)
        return (out, counts) if return_valid_counts else out

    # CSR form: row t keeps its first n_t (<= K) entries, packed at indptr[t].
    starts = indptr[:-1].long()
    n = (indptr[1:].long() - starts).clamp(0, K)
    if out is None:
        out = torch.empty(int(indptr[-1].item()), dtype=torch.int32, device=dev)
    cols = torch.arange(K, device=dev)
    keep = cols[None, :] < n[:, None]  # [T, K]
    dst = starts[:, None] + cols[None, :]
    keep_store = keep & (dst >= 0) & (dst < out.numel())
    out_flat = out.view(-1)
    out_flat[dst[keep_store]] = dense[keep_store]
    counts = (valid & keep).sum(dim=1, dtype=torch.int32) if T else torch.zeros(0, dtype=torch.int32, device=dev)
    return (out, counts) if return_valid_counts else out


def generate_sparse_seqlen_ref(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    *,
    num_tokens: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`dsa.metadata.generate_sparse_seqlen`.

    query_start_loc ``[R+1]`` int32 (cumulative query lengths), seq_lens ``[R]`` int32 (context
    lengths, including the new tokens). Token ``i`` (0-based inside request ``r``, with query
    length ``q = query_start_loc[r+1] - query_start_loc[r]`` and ``L = seq_lens[r]``) gets
    ``clamp(min(L - q + i + 1, topk), min=0)`` (0 when ``L == 0``). Tokens ``t`` outside every
    request (``t >= query_start_loc[-1]``, e.g. CUDA-graph padding) get 0.
    Returns ``[T]`` int32 with T = ``num_tokens`` / ``out.numel()`` / ``query_start_loc[-1]``.
    """
    dev = query_start_loc.device
    if out is not None:
        T = out.numel()
    elif num_tokens is not None:
        T = int(num_tokens)
    else:
        T = int(query_start_loc[-1].item())
    qsl = query_start_loc.long()
    R = seq_lens.shape[0]
    t = torch.arange(T, device=dev, dtype=torch.long)
    # request of token t: the last r with qsl[r] <= t (tokens past qsl[R] belong to none)
    r = torch.searchsorted(qsl, t, right=True) - 1
    inside = (r >= 0) & (r < R) & (t < qsl[-1])
    rc = r.clamp(0, max(R - 1, 0))
    if R > 0:
        start, end, L = qsl[rc], qsl[rc + 1], seq_lens.long()[rc]
        val = (L - (end - start) + (t - start) + 1).clamp(max=topk).clamp(min=0)
    else:
        val = torch.zeros_like(t)
    val = torch.where(inside, val, torch.zeros_like(val)).to(torch.int32)
    if out is None:
        return val
    out.copy_(val)
    return out
