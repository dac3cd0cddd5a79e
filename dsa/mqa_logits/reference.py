"""Plain PyTorch reference of the lightning indexer's logits (SPEC.md "Indexer").

These two functions define the semantics and are the tests' oracle. They take the
same arguments as the public ops, do every product and sum in float32, and read
the paged cache only through :func:`dsa.layouts.indexer_cache_views`.

    logits[i, j] = sum_h weights[i, h] * relu(q[i, h] . k[j]) * k_scale[j]    for ks[i] <= j < ke[i]
                 = -inf                                                      elsewhere (clean_logits)

With ``clean_logits=False`` the reference still writes ``-inf`` where it has no key
(paged: beyond the keys it gathered) and the formula's value everywhere else; the
public ops leave such entries unspecified.
"""
from __future__ import annotations

import torch

from ..layouts import indexer_cache_block_size, indexer_cache_views

# Rows per chunk are chosen so that one chunk's [rows, H, N] float32 scores stay
# under this many bytes (the reference must not blow memory on moderate tests).
_REF_CHUNK_BYTES = 1 << 28


def fp8_mqa_logits_ref(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits: bool = True) -> torch.Tensor:
    """q [M, H, D] e4m3fn; kv = (k [N, D] e4m3fn, k_scale [N] f32); weights [M, H] f32;
    cu_seqlen_ks / cu_seqlen_ke [M] int32. Returns logits [M, N] float32."""
    k, k_scale = kv
    M, H, _ = q.shape
    N = k.shape[0]
    kf = k.float()  # [N, D]
    scale = k_scale.reshape(N).float()
    cols = torch.arange(N, device=q.device)
    out = torch.empty(M, N, dtype=torch.float32, device=q.device)
    step = max(1, _REF_CHUNK_BYTES // max(1, H * N * 4))
    for s in range(0, M, step):
        e = min(M, s + step)
        scores = torch.einsum("mhd,nd->mhn", q[s:e].float(), kf)  # [m, H, N] fp32
        logits = (scores.relu() * weights[s:e, :, None].float()).sum(dim=1) * scale  # [m, N]
        if clean_logits:
            inside = (cols >= cu_seqlen_ks[s:e, None].long()) & (cols < cu_seqlen_ke[s:e, None].long())
            logits = logits.masked_fill(~inside, float("-inf"))
        out[s:e] = logits
    return out


def fp8_paged_mqa_logits_ref(
    q, cache, weights, context_lens, block_table, max_context_len: int, clean_logits: bool = True
) -> torch.Tensor:
    """q [B, next_n, H, D] e4m3fn; cache: indexer cache (any view accepted by
    dsa.layouts); weights [B*next_n, H] f32; context_lens [B] or [B, next_n] int32;
    block_table [B, max_blocks] int32. Returns logits [B*next_n, max_context_len] f32.

    Row ``b*next_n + j`` sees keys ``s < L_b - next_n + j + 1`` (1-D context_lens) or
    ``s < context_lens[b, j]`` (2-D), and never beyond ``max_context_len``.
    """
    B, next_n = q.shape[:2]
    values, scales = indexer_cache_views(cache)  # [nb, bs, D] fp8, [nb, bs] f32
    bs = indexer_cache_block_size(cache)
    out = torch.full((B * next_n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    j = torch.arange(next_n, device=q.device)
    for b in range(B):
        if context_lens.dim() == 1:
            limits = context_lens[b].long() - next_n + j + 1  # [next_n]
        else:
            limits = context_lens[b].long()
        limits = limits.clamp(0, max_context_len)
        L = int(limits.max())
        if L == 0:
            continue
        blocks = block_table[b, : (L + bs - 1) // bs].long()
        k = values[blocks].reshape(-1, values.shape[-1])[:L]  # the request's first L keys
        k_scale = scales[blocks].reshape(-1)[:L]
        rows = slice(b * next_n, (b + 1) * next_n)
        zeros = torch.zeros_like(limits)
        out[rows, :L] = fp8_mqa_logits_ref(q[b], (k, k_scale), weights[rows], zeros, limits, clean_logits)
    return out
