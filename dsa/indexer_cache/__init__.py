"""The lightning indexer's K cache (SPEC.md "Caches" 3 and "Indexer").

Public: ``indexer_k_quant``, ``indexer_k_quant_and_cache``, ``gather_indexer_k``.
"""
from __future__ import annotations

import torch

from .. import _replay, backend as _backend
from .._checks import check_block_size, check_same_device, check_tensor
from ..constants import INDEXER_HEAD_DIM
from ..layouts import indexer_cache_blocks
from . import reference as _ref
from .reference import SCALE_FMTS, gather_indexer_k_ref, indexer_k_quant_and_cache_ref

__all__ = [
    "indexer_k_quant",
    "indexer_k_quant_and_cache",
    "gather_indexer_k",
    "indexer_k_quant_and_cache_ref",
    "gather_indexer_k_ref",
    "SCALE_FMTS",
]


def _check_scale_fmt(scale_fmt):
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt: expected 'ue8m0' or None, got {scale_fmt!r}")


def _check_cache(cache) -> torch.Tensor:
    """Validate the indexer cache; return its canonical ``[num_blocks, block_size*132]`` view."""
    check_tensor("cache", cache, dtype=torch.uint8, ndim=(2, 3, 4))
    blocks = indexer_cache_blocks(cache)  # raises ValueError naming `cache` for bad shapes / strides
    check_block_size("cache block_size", blocks.shape[1] // (INDEXER_HEAD_DIM + 4))
    return blocks


@_replay.planned
def indexer_k_quant(
    k: torch.Tensor,
    scale_fmt: str | None = "ue8m0",
    *,
    backend: str | None = None,
):
    """Quantise indexer keys (or queries) to fp8 e4m3fn, one fp32 scale per 128 values.

    Args:
        k: ``[..., 128]`` bf16 (last dim contiguous; leading dims that do not flatten to one
            are copied first).
        scale_fmt: ``"ue8m0"``: ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))``;
            ``None``: ``scale = max(amax, 1e-4) / 448`` (fp32). Values
            ``fp8(clamp(k / scale, +-448))`` with an IEEE fp32 division, round to nearest even.

    Returns ``(k_fp8 [..., 128] float8_e4m3fn, scale [...] float32)``.
    """
    check_tensor("k", k, dtype=torch.bfloat16)
    if k.dim() < 1 or k.shape[-1] != INDEXER_HEAD_DIM:
        raise ValueError(f"k: expected shape [..., {INDEXER_HEAD_DIM}], got {list(k.shape)}")
    _check_scale_fmt(scale_fmt)
    if _backend.resolve(backend, k.device) == "reference":
        return _ref.indexer_k_quant(k, scale_fmt)
    from .kernel import indexer_k_quant_launch

    lead = k.shape[:-1]
    k2 = k.reshape(-1, INDEXER_HEAD_DIM)
    out_k = torch.empty(k2.shape, dtype=torch.uint8, device=k.device)
    out_s = torch.empty(k2.shape[0], dtype=torch.float32, device=k.device)
    indexer_k_quant_launch(k2, out_k, out_s, scale_fmt == "ue8m0")
    return out_k.view(torch.float8_e4m3fn).view(*lead, INDEXER_HEAD_DIM), out_s.view(lead)


@_replay.planned
def indexer_k_quant_and_cache(
    k: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_fmt: str | None = "ue8m0",
    *,
    backend: str | None = None,
) -> None:
    """Quantise indexer keys and write them into the paged indexer cache, in place.

    Args:
        k: ``[T, 128]`` bf16 (row stride free, last dim contiguous).
        cache: ``[num_blocks, block_size*132]`` uint8 (``[num_blocks, block_size, 132]`` and
            ``[num_blocks, block_size, 1, 132]`` accepted), contiguous, block-major inside a block
            (``dsa.layouts.indexer_cache_views``); block_size a power of two from 1 to 256.
        slot_mapping: ``[T']`` int64 (int32 accepted), ``T' <= T``: token ``t < T'`` goes to slot
            ``slot_mapping[t]``; other tokens are ignored. Slots ``< 0`` are skipped, and so are
            slots ``>= num_blocks*block_size`` (never written out of bounds).
        scale_fmt: ``"ue8m0"`` (power-of-two scales) or ``None`` (plain fp32 scales); see
            ``indexer_k_quant``.

    No host sync, no allocation; CUDA-graph safe.
    """
    check_tensor("k", k, dtype=torch.bfloat16, ndim=2, shape=[None, INDEXER_HEAD_DIM])
    blocks = _check_cache(cache)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int64, torch.int32), ndim=1)
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(
            f"slot_mapping: expected at most {k.shape[0]} entries (the tokens of k), got {slot_mapping.shape[0]}"
        )
    _check_scale_fmt(scale_fmt)
    device = check_same_device(k=k, cache=cache, slot_mapping=slot_mapping)
    if _backend.resolve(backend, device) == "reference":
        indexer_k_quant_and_cache_ref(k, cache, slot_mapping, scale_fmt)
        return
    from .kernel import indexer_k_quant_and_cache_launch

    indexer_k_quant_and_cache_launch(k, blocks, slot_mapping, scale_fmt == "ue8m0")


@_replay.planned
def gather_indexer_k(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    *,
    num_tokens: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
):
    """Concatenate the cached indexer keys of several requests (for ``fp8_mqa_logits``).

    Args:
        cache: the indexer cache (see ``indexer_k_quant_and_cache``).
        block_table: ``[B, max_blocks]`` int32 (int64 accepted), last dim contiguous.
        cu_seq_lens: ``[B+1]`` int32 or int64, non-decreasing: request ``r`` contributes its first
            ``cu_seq_lens[r+1] - cu_seq_lens[r]`` tokens (token ``p`` read from block
            ``block_table[r, p // block_size]``) to output rows ``cu_seq_lens[r] + p``.
        num_tokens: N, the number of output rows. If omitted: the size of ``out`` if given, else
            ``cu_seq_lens[-1].item()`` -- a host<->device sync (pass ``num_tokens`` or ``out`` to
            avoid it, e.g. under CUDA graphs).
        out: optional ``(k_fp8 [N, 128] float8_e4m3fn (row stride free), k_scale [N] float32
            contiguous)`` written instead of allocating.

    Returns ``(k_fp8 [N, 128] float8_e4m3fn, k_scale [N] float32)``. Rows ``>= cu_seq_lens[-1]``
    (and any row no request covers) are not written; tokens whose row would be ``>= N`` are
    dropped. A token whose block id is outside ``[0, num_blocks)`` (e.g. ``-1``) or beyond the
    table's width reads as zero bytes with scale 0 (never out of bounds).
    """
    blocks = _check_cache(cache)
    check_tensor("block_table", block_table, dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor("cu_seq_lens", cu_seq_lens, dtype=(torch.int32, torch.int64), ndim=1)
    if cu_seq_lens.shape[0] < 1 or cu_seq_lens.shape[0] != block_table.shape[0] + 1:
        raise ValueError(
            f"cu_seq_lens: expected shape [{block_table.shape[0] + 1}] (block_table rows + 1), "
            f"got {list(cu_seq_lens.shape)}"
        )
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
        raise ValueError(f"num_tokens: expected a non-negative int or None, got {num_tokens!r}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"out: expected a tuple (k_fp8, k_scale), got {type(out).__name__}")
        n = out[0].shape[0] if isinstance(out[0], torch.Tensor) and out[0].dim() > 0 else None
        if num_tokens is not None:
            n = num_tokens
        check_tensor("out[0]", out[0], dtype=torch.float8_e4m3fn, shape=[n, INDEXER_HEAD_DIM])
        check_tensor("out[1]", out[1], dtype=torch.float32, shape=[n], contiguous=True)
    device = check_same_device(
        cache=cache, block_table=block_table, cu_seq_lens=cu_seq_lens,
        **({"out[0]": out[0], "out[1]": out[1]} if out is not None else {}),
    )
    if num_tokens is None:
        num_tokens = out[0].shape[0] if out is not None else int(cu_seq_lens[-1].item())  # host sync
    if _backend.resolve(backend, device) == "reference":
        return gather_indexer_k_ref(cache, block_table, cu_seq_lens, num_tokens, out)
    from .kernel import gather_indexer_k_launch

    if out is None:
        out = (
            torch.empty(num_tokens, INDEXER_HEAD_DIM, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(num_tokens, dtype=torch.float32, device=device),
        )
    gather_indexer_k_launch(blocks, block_table, cu_seq_lens, out[0].view(torch.uint8), out[1])
    return out[0], out[1]
