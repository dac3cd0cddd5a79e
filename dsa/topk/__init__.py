"""Indexer top-k (SPEC.md "Indexer", ``top_k_indices``): exact Triton threshold selection.

Public: :func:`top_k_indices`. Semantics: :mod:`dsa.topk.reference`; design: :mod:`dsa.topk.kernel`.
"""
from __future__ import annotations

import torch

from .. import _checks, _replay
from ..backend import resolve
from .kernel import MAX_K, TopKConfig, top_k_indices_launch
from ..metadata.reference import convert_req_index_to_global_index_ref
from .reference import top_k_indices_decode_ref, top_k_indices_ref

__all__ = ["MAX_K", "TopKConfig", "top_k_indices", "top_k_indices_decode_ref", "top_k_indices_ref"]


def _validate(logits, k, row_starts, row_ends, seq_lens, next_n, out, block_table=None, block_size=None):
    _checks.check_tensor("logits", logits, dtype=torch.float32, ndim=2)
    M = logits.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k: expected an int from 1 to {MAX_K}, got {k!r}")
    explicit = row_starts is not None or row_ends is not None
    if explicit and seq_lens is not None:
        raise ValueError(
            "seq_lens: expected None when row_starts/row_ends are given (use either the explicit-range "
            "form or the decode form), got a tensor"
        )
    if explicit:
        if row_starts is None or row_ends is None:
            missing = "row_starts" if row_starts is None else "row_ends"
            raise ValueError(f"{missing}: expected an int32 tensor [{M}] (row_starts and row_ends go together), got None")
        _checks.check_tensor("row_starts", row_starts, dtype=torch.int32, shape=(M,))
        _checks.check_tensor("row_ends", row_ends, dtype=torch.int32, shape=(M,))
        _checks.check_same_device(logits=logits, row_starts=row_starts, row_ends=row_ends)
        mode = 0
    elif seq_lens is not None:
        _checks.check_positive_int("next_n", next_n)
        _checks.check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=(1, 2))
        B = seq_lens.shape[0]
        if seq_lens.dim() == 2 and seq_lens.shape[1] != next_n:
            raise ValueError(f"seq_lens: expected shape [B, next_n={next_n}], got {list(seq_lens.shape)}")
        if B * next_n != M:
            raise ValueError(
                f"logits: expected {B * next_n} rows (B={B} requests x next_n={next_n}), got shape {list(logits.shape)}"
            )
        _checks.check_same_device(logits=logits, seq_lens=seq_lens)
        mode = 1 if seq_lens.dim() == 1 else 2
    else:
        raise ValueError("row_starts: expected row_starts and row_ends (explicit ranges) or seq_lens (decode form), got neither")
    if block_table is not None or block_size is not None:
        if mode == 0:
            raise ValueError("block_table: global cache slots need the decode form (seq_lens), got explicit ranges")
        if block_table is None or block_size is None:
            missing = "block_table" if block_table is None else "block_size"
            raise ValueError(f"{missing}: expected it with {'block_size' if block_table is None else 'block_table'} "
                             "(global cache slots need both), got None")
        _checks.check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=False)
        _checks.check_dim("block_table", block_table.shape[0], seq_lens.shape[0], "rows (one per request)")
        _checks.check_block_size("block_size", block_size)
        _checks.check_same_device(logits=logits, block_table=block_table)
    if out is not None:
        _checks.check_tensor("out", out, dtype=torch.int32, shape=(M, k))
        _checks.check_same_device(logits=logits, out=out)
    return mode


@_replay.planned(slack=("logits",))
def top_k_indices(
    logits: torch.Tensor,
    k: int,
    row_starts: torch.Tensor | None = None,
    row_ends: torch.Tensor | None = None,
    *,
    seq_lens: torch.Tensor | None = None,
    next_n: int = 1,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    config: TopKConfig | None = None,
) -> torch.Tensor:
    """Positions of the k largest logits of each row's range, relative to the range start (or, in the
    decode form with ``block_table``, their global cache slots).

    Two forms (exactly one):

    * explicit ranges: ``row_starts``, ``row_ends`` ``[M]`` int32; row ``i`` covers
      ``logits[i, row_starts[i]:row_ends[i]]`` (the prefill indexer's ks/ke);
    * decode: ``seq_lens`` ``[B]`` int32 and ``next_n``: row ``b*next_n + j`` covers
      ``[0, seq_lens[b] - next_n + j + 1)``; or ``seq_lens`` ``[B, next_n]``: ``[0, seq_lens[b, j])``.

    Args:
        logits: ``[M, N]`` float32, last dim contiguous (any row stride).
        k: 1 <= k <= ``MAX_K`` (8192).
        block_table: optional, decode form only: ``[B, max_blocks]`` int32 (any strides), each request's
            physical blocks; with it the output holds global slots (below) instead of positions, which saves
            :func:`dsa.metadata.convert_req_index_to_global_index`'s launch.
        block_size: the cache's block size (a power of two from 1 to 256), with ``block_table``.
        out: optional ``[M, k]`` int32 output (last dim contiguous), written in full.
        backend: ``None``/"auto", "triton" or "reference" (see :mod:`dsa.backend`).
        config: optional :class:`TopKConfig` launch parameters (tuning; the result does not depend on it).

    Returns:
        ``[M, k]`` int32: per row the positions of the k largest values, ascending, then
        ``-1``; a range of length ``L <= k`` gives ``0..L-1`` then ``-1``. NaN and ``-inf``
        rank below every other value (chosen only when fewer than k others exist); among
        equal values the lowest positions win. The result is fully determined by the input
        (bitwise identical on every run and for every ``config``). Ranges are clamped to
        ``[0, N]`` (valid inputs have ``0 <= start <= end <= N``; not checked, to avoid a sync).
        With ``block_table``: entry ``p >= 0`` of row ``b * next_n + j`` becomes
        ``block_table[b, p // block_size] * block_size + p % block_size``, and ``-1`` where that block is
        past ``max_blocks``, its entry is negative or the slot does not fit in int32: exactly
        :func:`dsa.metadata.convert_req_index_to_global_index` of the positions with ``req_id = row //
        next_n``.

    No host-device synchronisation; allocates only ``out`` (when not given) and a scratch
    buffer; CUDA-graph safe for fixed shapes.
    """
    mode = _validate(logits, k, row_starts, row_ends, seq_lens, next_n, out, block_table, block_size)
    M = logits.shape[0]
    if out is None:
        out = torch.empty((M, k), dtype=torch.int32, device=logits.device)
    if resolve(backend, logits.device) == "reference":
        if mode == 0:
            res = top_k_indices_ref(logits, k, row_starts, row_ends)
        else:
            res = top_k_indices_decode_ref(logits, k, seq_lens, next_n)
            if block_table is not None:
                req_id = torch.div(torch.arange(M, device=logits.device), next_n, rounding_mode="floor").int()
                res = convert_req_index_to_global_index_ref(req_id, block_table, res, block_size)
        out.copy_(res)
        return out
    return top_k_indices_launch(
        logits, k, out, mode=mode, row_starts=row_starts, row_ends=row_ends,
        seq_lens=seq_lens, next_n=next_n, block_table=block_table, block_size=block_size or 1, config=config,
    )
