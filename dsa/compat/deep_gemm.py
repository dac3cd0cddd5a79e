"""DeepGEMM's lightning-indexer logits on :func:`dsa.fp8_mqa_logits` and :func:`dsa.fp8_paged_mqa_logits`.

``from dsa.compat import deep_gemm`` gives code written for DeepGEMM's ``fp8_mqa_logits`` /
``fp8_paged_mqa_logits`` the same calls on any GPU Triton runs on: the same argument order, shapes and formula
(SPEC.md "Indexer"; the paged cache in DeepGEMM's layout, ``[num_blocks, block_size, 1, 132]`` uint8).

Differences, decided here:

* the paged call's ``schedule_meta`` is not read; :func:`get_paged_mqa_logits_metadata` returns an empty int32
  tensor for it (dsa's kernel needs no schedule), whatever its arguments (they differ between DeepGEMM versions);
* ``q`` may also be given as the pair ``(q, None)`` that newer DeepGEMM wrappers pass (an fp4 ``q`` with scales
  is not taken);
* the compressed prefill form (``max_seqlen_k > 0``: ``logits[i, j]`` for key ``ks[i] + j``) is computed by dsa's
  kernel over row chunks of at most :data:`COMPRESSED_CHUNK_BYTES` of full-width logits, then gathered: its memory
  stays that bound over the output, but it writes and reads the full width once (DeepGEMM's kernel writes only the
  windows); every entry past a row's range is ``-inf`` (DeepGEMM leaves them unspecified).
"""
from __future__ import annotations

import torch

from .._checks import check_tensor
from ..backend import num_sms
from ..mqa_logits import fp8_mqa_logits as _fp8_mqa_logits
from ..mqa_logits import fp8_paged_mqa_logits as _fp8_paged_mqa_logits

__all__ = ["fp8_mqa_logits", "fp8_paged_mqa_logits", "get_paged_mqa_logits_metadata", "get_num_sms",
           "COMPRESSED_CHUNK_BYTES"]

#: the most bytes of full-width fp32 logits one chunk of rows of the compressed form computes at once
COMPRESSED_CHUNK_BYTES = 256 << 20


def get_num_sms() -> int:
    """The current CUDA device's SM count (DeepGEMM's ``get_num_sms``); 1 without a GPU."""
    if not torch.cuda.is_available():
        return 1
    return num_sms(torch.device("cuda", torch.cuda.current_device()))


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """DeepGEMM's schedule for :func:`fp8_paged_mqa_logits`: an empty ``[0, 2]`` int32 tensor on
    ``context_lens``' device (not read: dsa's paged kernel needs no schedule)."""
    check_tensor("context_lens", context_lens, dtype=torch.int32, ndim=(1, 2))
    return torch.empty(0, 2, dtype=torch.int32, device=context_lens.device)


def _fp8_q(q) -> torch.Tensor:
    if isinstance(q, (tuple, list)):
        if len(q) != 2 or q[1] is not None:
            raise ValueError("q: expected a tensor or the pair (q, None); fp4 queries with scales are not "
                             "supported by dsa")
        q = q[0]
    return q


def fp8_mqa_logits(
    q,
    kv,
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """DeepGEMM's prefill indexer logits.

    Args:
        q: ``[M, H, 128]`` float8_e4m3fn (or ``(q, None)``).
        kv: ``(k [N, 128] float8_e4m3fn, k_scale [N] f32)``.
        weights: ``[M, H]`` f32.
        cu_seq_len_k_start, cu_seq_len_k_end: ``[M]`` int32, row i's keys ``[ks[i], ke[i])``.
        clean_logits: ``-inf`` outside each row's range (the full form; else unspecified there).
        max_seqlen_k: 0 for the full ``[M, N]`` logits; else the width of the compressed ``[M, max_seqlen_k]``
            logits, entry ``(i, j)`` for key ``ks[i] + j`` (``-inf`` where that key is outside ``[ks[i], ke[i])``
            or outside the keys).
        backend: dsa's backend choice (keyword only).
    """
    q = _fp8_q(q)
    if isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int) or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k: expected a non-negative int, got {max_seqlen_k!r}")
    if max_seqlen_k == 0:
        return _fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits, backend=backend)
    # the compressed form: the full-width logits of a chunk of rows (each call checks its arguments), then the
    # window of each row
    check_tensor("q", q, ndim=3)
    M = q.shape[0]
    for name, t in (("weights", weights), ("cu_seq_len_k_start", cu_seq_len_k_start),
                    ("cu_seq_len_k_end", cu_seq_len_k_end)):
        check_tensor(name, t, ndim=(1, 2))
        if t.shape[0] != M:
            raise ValueError(f"{name}: expected {M} rows (M from q), got shape {list(t.shape)}")
    k = kv[0] if isinstance(kv, (tuple, list)) and len(kv) == 2 and isinstance(kv[0], torch.Tensor) else None
    rows = max(1, COMPRESSED_CHUNK_BYTES // (4 * max(k.shape[0] if k is not None else 0, 1)))
    out = torch.empty(M, max_seqlen_k, dtype=torch.float32, device=q.device)
    cols = torch.arange(max_seqlen_k, device=q.device)
    for r0 in range(0, max(M, 1), rows):  # (one call at M = 0: its checks)
        r1 = min(M, r0 + rows)
        ks, ke = cu_seq_len_k_start[r0:r1], cu_seq_len_k_end[r0:r1]
        full = _fp8_mqa_logits(q[r0:r1], kv, weights[r0:r1], ks, ke, True, backend=backend)
        n_keys = full.shape[1]
        if r1 == r0 or n_keys == 0:
            out[r0:r1] = float("-inf")
            continue
        key = ks[:, None].long() + cols  # [rows, max_seqlen_k]
        inside = (key >= 0) & (key < ke[:, None].long()) & (key < n_keys)
        out[r0:r1] = torch.where(inside, full.gather(1, key.clamp(0, n_keys - 1)), float("-inf"))
    return out


def fp8_paged_mqa_logits(
    q,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta,
    max_context_len: int,
    clean_logits: bool = True,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """DeepGEMM's decode indexer logits over the paged indexer cache.

    Args:
        q: ``[B, next_n, H, 128]`` float8_e4m3fn (or ``(q, None)``).
        kv_cache: ``[num_blocks, block_size, 1, 132]`` uint8 (DeepGEMM's layout; SPEC.md's other views accepted).
        weights: ``[B * next_n, H]`` f32.
        context_lens: ``[B]`` or ``[B, next_n]`` int32.
        block_table: ``[B, max_blocks]`` int32.
        schedule_meta: from :func:`get_paged_mqa_logits_metadata` (not read).
        max_context_len: the output width.
        clean_logits: ``-inf`` outside each row's range (else unspecified there).
        backend: dsa's backend choice (keyword only).

    Returns:
        ``[B * next_n, max_context_len]`` f32.
    """
    return _fp8_paged_mqa_logits(_fp8_q(q), kv_cache, weights, context_lens, block_table, max_context_len,
                                 clean_logits, backend=backend)
