"""Plain PyTorch reference for the indexer top-k (SPEC.md "Indexer", ``top_k_indices``).

This file defines the semantics; the Triton kernel (``kernel.py``) returns exactly
the same tensor (bit for bit) on every input.

Ordering. Every fp32 value gets an order key (:func:`order_keys`): finite values and
``+inf`` keep their order, while ``-inf`` and every NaN share the lowest key. So NaN
and ``-inf`` are never preferred to a finite value, but they are still *candidates*:
a range holding fewer than ``k`` finite values returns its NaN/``-inf`` positions
too (which keeps SPEC's rule "a range of length <= k returns 0..len-1" consistent).
``-0.0`` ranks just below ``+0.0``.

Canonical choice. SPEC leaves the choice among ties and the order of the valid
entries open. We fix both so that the result is a function of the input alone:
among equal keys the lowest positions win, and the chosen positions are written in
ascending order, followed by ``-1``.

Ranges. Row ``i`` covers ``logits[i, s:e]`` with ``s = clamp(row_starts[i], 0, N)``
and ``e = clamp(row_ends[i], s, N)`` (valid inputs satisfy
``0 <= row_starts <= row_ends <= N``; values outside are clamped, never read out of
bounds). Positions are relative to ``s``.
"""
from __future__ import annotations

import torch

__all__ = ["decode_row_ranges", "order_keys", "top_k_indices_decode_ref", "top_k_indices_ref"]


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """Order-preserving map fp32 -> int64 key in ``[0, 2**32)``.

    ``key(a) < key(b)`` iff ``a < b`` for non-NaN ``a, b`` other than ``-inf``
    (with ``-0.0 < +0.0``); ``-inf`` and NaN map to 0, below every other value.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x: expected dtype float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = bits >= 0x80000000
    key = torch.where(negative, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return torch.where(x > float("-inf"), key, torch.zeros_like(key))


def top_k_indices_ref(
    logits: torch.Tensor, k: int, row_starts: torch.Tensor, row_ends: torch.Tensor
) -> torch.Tensor:
    """Reference ``top_k_indices`` in the explicit-range form.

    Args:
        logits: ``[M, N]`` float32.
        k: number of positions per row (positive int).
        row_starts, row_ends: ``[M]`` int32, row ``i`` covers ``logits[i, row_starts[i]:row_ends[i]]``.

    Returns:
        ``[M, k]`` int32 on ``logits.device``: the canonical top-k positions of each row,
        relative to the row start, ascending, then ``-1``. Runs on ``logits.device`` (whole rows
        at a time, in chunks of rows that bound the int64 temporaries to about 1 GiB).
    """
    M, N = logits.shape
    dev = logits.device
    out = torch.full((M, k), -1, dtype=torch.int32, device=dev)
    if M == 0 or N == 0:
        return out
    starts = row_starts.detach().to(dev, torch.int64).clamp(0, N)
    ends = torch.maximum(row_ends.detach().to(dev, torch.int64).clamp(max=N), starts)
    pos = torch.arange(N, dtype=torch.int64, device=dev)
    kk = min(k, N)
    rows = max(1, (1 << 27) // N)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        s, e = starts[r0:r1, None], ends[r0:r1, None]
        rel = pos[None, :] - s  # position relative to the row start
        # one unique int64 per entry: larger key first, then lower position first (key < 2**32 and
        # rel < 2**31, so key * 2**31 + (2**31 - 1 - rel) < 2**63); entries outside the range get -1,
        # below every entry inside it, so a range of length <= k returns all of its positions
        composite = order_keys(logits[r0:r1].detach().float()) * (1 << 31) + ((1 << 31) - 1 - rel)
        composite = torch.where((pos[None, :] >= s) & (pos[None, :] < e), composite, -1)
        top = torch.topk(composite, kk, dim=1)
        chosen = torch.where(top.values >= 0, top.indices - s, N)  # N: "no entry", sorts last
        chosen = torch.sort(chosen, dim=1).values
        out[r0:r1, :kk] = torch.where(chosen < N, chosen, -1).to(torch.int32)
    return out


def decode_row_ranges(seq_lens: torch.Tensor, next_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ranges of the decode form: ``(row_starts, row_ends)``, each ``[B * next_n]`` int32.

    1-D ``seq_lens [B]``: row ``b*next_n + j`` covers ``[0, seq_lens[b] - next_n + j + 1)``
    (MTP: draft token ``j`` of request ``b`` sees the keys up to and including itself).
    2-D ``seq_lens [B, next_n]``: row ``b*next_n + j`` covers ``[0, seq_lens[b, j])``.
    A negative end means an empty row.
    """
    sl = seq_lens.detach().to(torch.int64)
    if sl.dim() == 1:
        j = torch.arange(next_n, dtype=torch.int64, device=sl.device)
        ends = sl[:, None] - next_n + j[None, :] + 1
    else:
        ends = sl
    ends = ends.reshape(-1).clamp_min(0).to(torch.int32)
    return torch.zeros_like(ends), ends


def top_k_indices_decode_ref(logits: torch.Tensor, k: int, seq_lens: torch.Tensor, next_n: int = 1) -> torch.Tensor:
    """Reference ``top_k_indices`` in the decode form (see :func:`decode_row_ranges`).

    Args:
        logits: ``[B * next_n, N]`` float32 (the paged MQA logits).
        k: number of positions per row.
        seq_lens: ``[B]`` or ``[B, next_n]`` int32.
        next_n: query tokens per request (MTP), >= 1.

    Returns:
        ``[B * next_n, k]`` int32, as :func:`top_k_indices_ref`.
    """
    starts, ends = decode_row_ranges(seq_lens, next_n)
    return top_k_indices_ref(logits, k, starts, ends)
