"""Sparse MLA attention in plain PyTorch: the semantics of :func:`dsa.sparse_mla` and the test oracle.

For query token ``t`` and head ``h`` with the gathered cache rows ``k_j = kv[indices[t, j]]``
(576 values, ``[c_kv (512) | k_pe (64)]``; V is ``k_j[:512]``), over the *valid* entries only
(``0 <= indices[t, j] < S`` and ``j < topk_length[t]``)::

    P_j        = sm_scale * (q[t, h] . k_j)                 fp32
    max_logits = max_j P_j
    lse        = log sum_j exp(P_j)                          natural log
    out        = sum_j exp(P_j - lse') * k_j[:512]           lse' = logaddexp(lse, attn_sink[h]), or lse without a sink

fp8_ds_mla rows are first dequantised to bf16 (``fp8 * scale`` in fp32, rounded to bf16); all
products accumulate in fp32. A (t, h) without a single valid entry gets ``out = 0``,
``lse = +inf`` and ``max_logits = -inf`` (FlashMLA's convention), never NaN. Only valid rows
are gathered, so whatever an unused cache slot holds (NaN included) cannot reach a result.
"""
from __future__ import annotations

import torch

from ..constants import D_QK, D_V, FP8_DS_MLA_ROW_BYTES
from ..mla_cache.reference import dequantize_fp8_ds_mla

# tokens per chunk are chosen so that one chunk's fp32 gathered rows stay near this many bytes
_CHUNK_BYTES = 256 << 20


def flat_kv(kv: torch.Tensor) -> torch.Tensor:
    """The MLA cache as ``[S, 576]`` bf16 or ``[S, 656]`` uint8 rows (paged shapes flattened, a view)."""
    width = D_QK if kv.dtype == torch.bfloat16 else FP8_DS_MLA_ROW_BYTES
    return kv.reshape(-1, width)


def gather_rows_bf16(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``kv[slots]`` as bf16 ``[..., 576]``; fp8_ds_mla rows are dequantised (fp8 * scale in fp32 -> bf16)."""
    kv = flat_kv(kv)
    if kv.dtype == torch.bfloat16:
        return kv[slots]
    return dequantize_fp8_ds_mla(kv[slots])


def valid_mask(indices: torch.Tensor, num_slots: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """``[T, topk]`` bool: entry j of row t is valid iff 0 <= idx < S and j < topk_length[t]."""
    valid = (indices >= 0) & (indices < num_slots)
    if topk_length is not None:
        j = torch.arange(indices.shape[1], device=indices.device)
        valid &= j[None, :] < topk_length[:, None].to(indices.device)
    return valid


def sparse_mla_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
):
    """Reference sparse MLA attention (see the module docstring for the formula).

    q ``[T, h_q, 576]`` bf16; kv bf16 ``[S, 576]`` / ``[nb, bs, 576]`` or fp8_ds_mla uint8 ``[S, 656]`` /
    ``[nb, bs, 656]`` / ``[nb, bs, 1, 656]`` (S = nb * bs); indices ``[T, topk]`` int32 global slots;
    attn_sink ``[h_q]`` f32 or None; topk_length ``[T]`` int32 or None.
    Returns ``(out [T, h_q, d_v] bf16, max_logits [T, h_q] f32, lse [T, h_q] f32)``.
    Tokens are processed in chunks so that memory stays moderate.
    """
    kv = flat_kv(kv)
    num_slots = kv.shape[0]
    T, h_q, _ = q.shape
    topk = indices.shape[1]
    dev = q.device
    out = torch.zeros(T, h_q, d_v, dtype=torch.bfloat16, device=dev)
    max_logits = torch.full((T, h_q), float("-inf"), dtype=torch.float32, device=dev)
    lse = torch.full((T, h_q), float("inf"), dtype=torch.float32, device=dev)
    if T == 0 or topk == 0:
        return out, max_logits, lse
    valid = valid_mask(indices.to(dev).long(), num_slots, topk_length)
    chunk = max(1, _CHUNK_BYTES // (topk * D_QK * 4 + h_q * topk * 8))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        ok = valid[t0:t1]  # [c, topk]
        rows = torch.zeros(t1 - t0, topk, D_QK, dtype=torch.float32, device=dev)
        # gather only the valid rows; masked rows stay 0 (never a cache value, so NaN cannot leak)
        rows[ok] = gather_rows_bf16(kv, indices[t0:t1].to(dev).long()[ok]).float()
        logits = sm_scale * torch.einsum("thd,tjd->thj", q[t0:t1].float(), rows)  # [c, h_q, topk]
        logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
        m = logits.amax(dim=-1)
        l = torch.logsumexp(logits, dim=-1)  # -inf where no entry is valid
        empty = ~ok.any(dim=-1)  # [c]
        denom = l if attn_sink is None else torch.logaddexp(l, attn_sink.float()[None, :])
        w = torch.exp(logits - denom[..., None])  # exp(-inf) = 0 for masked entries
        w = torch.where(empty[:, None, None], torch.zeros_like(w), w)  # empty rows: -inf - -inf would be NaN
        o = torch.einsum("thj,tjd->thd", w, rows[..., :d_v])
        out[t0:t1] = o.to(torch.bfloat16)
        max_logits[t0:t1] = m
        lse[t0:t1] = torch.where(empty[:, None], torch.full_like(l, float("inf")), l)
    return out, max_logits, lse
