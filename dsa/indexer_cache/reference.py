"""Plain PyTorch reference for the lightning indexer's key cache (SPEC.md "Caches" 3, "Indexer").

Quantisation (one fp32 scale per token of 128 values):
``scale = max(amax, 1e-4) / 448`` (IEEE fp32 division), rounded UP to a power of two when
``scale_fmt == "ue8m0"`` (exact bit arithmetic, see ``dsa.fp8.pow2_ceil``),
kept as is when ``scale_fmt is None``; ``k_fp8 = fp8_e4m3fn(clamp(k / scale, +-448))``,
round to nearest even. The division ``k / scale`` is an IEEE fp32 division (not
``k * (1/scale)``); for a power-of-two scale the two are identical, for the plain scale they
can differ in the last bit of the quotient, and the kernel divides too.

The cache is block-major inside a block: ``[num_blocks, block_size * 132]`` uint8, fp8 values
of token ``t`` at bytes ``t*128``, its fp32 scale at ``block_size*128 + 4*t``
(``dsa.layouts.indexer_cache_views``).
"""
from __future__ import annotations

import torch

from ..constants import INDEXER_HEAD_DIM
from ..fp8 import quantize_fp8_groups
from ..layouts import indexer_cache_views

SCALE_FMTS = ("ue8m0", None)


def _check_scale_fmt(scale_fmt):
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt: expected 'ue8m0' or None, got {scale_fmt!r}")


def indexer_k_quant(k: torch.Tensor, scale_fmt: str | None = "ue8m0"):
    """Quantise ``k [..., 128]`` (bf16) per row: returns ``(k_fp8 [..., 128] float8_e4m3fn, scale [...] float32)``."""
    _check_scale_fmt(scale_fmt)
    q, s = quantize_fp8_groups(k, INDEXER_HEAD_DIM, ue8m0=scale_fmt == "ue8m0")
    return q, s.squeeze(-1)


def indexer_k_quant_and_cache_ref(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_fmt: str | None = "ue8m0",
) -> None:
    """Quantise ``k [T, 128]`` and write token ``t`` into slot ``slot_mapping[t]`` of the indexer cache.

    Only the first ``slot_mapping.shape[0]`` tokens are used; slots ``< 0`` and slots
    ``>= num_blocks * block_size`` are skipped.
    """
    values, scales = indexer_cache_views(cache)  # [nb, bs, 128] fp8, [nb, bs] f32
    nb, bs = scales.shape
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    keep = (slots >= 0) & (slots < nb * bs)
    q, s = indexer_k_quant(k[:n][keep], scale_fmt)
    dst = slots[keep]
    blk, off = dst // bs, dst % bs
    values.view(torch.uint8)[blk, off] = q.view(torch.uint8)
    scales[blk, off] = s


def gather_indexer_k_ref(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    num_tokens: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Concatenate the cached keys of several requests.

    Request ``r`` contributes its first ``L_r = cu_seq_lens[r+1] - cu_seq_lens[r]`` tokens, token
    ``p`` read from block ``block_table[r, p // bs]`` at offset ``p % bs``, written to output row
    ``cu_seq_lens[r] + p``. Output rows ``>= N`` are dropped; output rows no request covers are
    not written. A token whose block entry is outside ``[0, num_blocks)`` (or beyond the table's
    width) reads as zero bytes with scale 0.

    ``N = num_tokens`` if given, else the size of ``out``, else ``cu_seq_lens[-1]``.
    Returns ``(k_fp8 [N, 128] float8_e4m3fn, k_scale [N] float32)``; freshly allocated rows
    that nothing writes are zero.
    """
    values, scales = indexer_cache_views(cache)
    nb, bs = scales.shape
    cu = [int(v) for v in cu_seq_lens.tolist()]
    if num_tokens is None:
        num_tokens = out[1].shape[0] if out is not None else cu[-1]
    if out is None:
        k_out = torch.zeros(num_tokens, INDEXER_HEAD_DIM, dtype=torch.uint8, device=cache.device)
        s_out = torch.zeros(num_tokens, dtype=torch.float32, device=cache.device)
    else:
        k_out, s_out = out[0].view(torch.uint8), out[1]
    vbytes = values.view(torch.uint8)
    width = block_table.shape[1]
    for r in range(len(cu) - 1):
        j = torch.arange(cu[r], cu[r + 1], device=cache.device)  # output rows of request r
        p = j - cu[r]  # token positions inside the request
        j, p = j[(j >= 0) & (j < num_tokens)], p[(j >= 0) & (j < num_tokens)]
        col = p // bs
        b = torch.full_like(p, -1)
        b[col < width] = block_table[r, col[col < width]].to(torch.int64)
        ok = (b >= 0) & (b < nb)
        k_out[j[~ok]] = 0
        s_out[j[~ok]] = 0.0
        k_out[j[ok]] = vbytes[b[ok], p[ok] % bs]
        s_out[j[ok]] = scales[b[ok], p[ok] % bs]
    if out is not None:
        return out[0], out[1]
    return k_out.view(torch.float8_e4m3fn), s_out
