"""Typed views of the two byte-level cache formats (SPEC.md "Caches").

These are the one place where the byte layouts are spelled out in code; every
reference, packer and test goes through them. All functions return *views*
that alias the cache memory (writing into them writes the cache).
"""
from __future__ import annotations

import torch

from .constants import (
    FP8_DS_MLA_NUM_GROUPS,
    FP8_DS_MLA_ROPE_OFFSET,
    FP8_DS_MLA_ROW_BYTES,
    FP8_DS_MLA_SCALE_OFFSET,
    INDEXER_HEAD_DIM,
    INDEXER_ROW_BYTES,
    ROPE_DIM,
)


def fp8_ds_mla_views(rows: torch.Tensor):
    """Split fp8_ds_mla rows ``[..., 656]`` uint8 into aliasing views.

    Returns ``(values [..., 512] float8_e4m3fn, scales [..., 4] float32, rope [..., 64] bfloat16)``.
    """
    if rows.dtype != torch.uint8 or rows.shape[-1] != FP8_DS_MLA_ROW_BYTES:
        raise ValueError(f"rows: expected uint8 [..., {FP8_DS_MLA_ROW_BYTES}], got {rows.dtype} {list(rows.shape)}")
    values = rows[..., :FP8_DS_MLA_SCALE_OFFSET].view(torch.float8_e4m3fn)
    scales = rows[..., FP8_DS_MLA_SCALE_OFFSET:FP8_DS_MLA_ROPE_OFFSET].view(torch.float32)
    rope = rows[..., FP8_DS_MLA_ROPE_OFFSET:].view(torch.bfloat16)
    assert scales.shape[-1] == FP8_DS_MLA_NUM_GROUPS and rope.shape[-1] == ROPE_DIM
    return values, scales, rope


def indexer_cache_blocks(cache: torch.Tensor) -> torch.Tensor:
    """Normalise an indexer cache to its canonical ``[num_blocks, block_size * 132]`` uint8 view.

    Accepts ``[nb, bs*132]``, ``[nb, bs, 132]`` and ``[nb, bs, 1, 132]``.
    """
    if cache.dtype != torch.uint8:
        raise TypeError(f"cache: expected dtype uint8, got {cache.dtype}")
    if not cache.is_contiguous():  # (asked of the cache itself: reshaping a strided one would copy it)
        raise ValueError(f"cache: expected a contiguous tensor, got shape {list(cache.shape)} strides {cache.stride()}")
    if cache.dim() == 2:
        if cache.shape[1] % INDEXER_ROW_BYTES:
            raise ValueError(f"cache: expected last dim a multiple of {INDEXER_ROW_BYTES}, got {list(cache.shape)}")
        flat = cache
    elif cache.dim() in (3, 4) and cache.shape[-1] == INDEXER_ROW_BYTES and (cache.dim() == 3 or cache.shape[2] == 1):
        flat = cache.reshape(cache.shape[0], -1)
    else:
        raise ValueError(
            f"cache: expected [num_blocks, block_size*{INDEXER_ROW_BYTES}], [num_blocks, block_size, {INDEXER_ROW_BYTES}] "
            f"or [num_blocks, block_size, 1, {INDEXER_ROW_BYTES}], got {list(cache.shape)}"
        )
    return flat


def indexer_cache_block_size(cache: torch.Tensor) -> int:
    return indexer_cache_blocks(cache).shape[1] // INDEXER_ROW_BYTES


def indexer_cache_views(cache: torch.Tensor):
    """Split the block-major indexer cache into aliasing views.

    Inside block ``b``: bytes ``[0, bs*128)`` are the fp8 values (token ``t`` at ``t*128``),
    bytes ``[bs*128, bs*132)`` one fp32 scale per token (DeepGEMM's layout).
    Returns ``(values [nb, bs, 128] float8_e4m3fn, scales [nb, bs] float32)``.
    """
    flat = indexer_cache_blocks(cache)
    nb = flat.shape[0]
    bs = flat.shape[1] // INDEXER_ROW_BYTES
    values = flat[:, : bs * INDEXER_HEAD_DIM].view(torch.float8_e4m3fn).view(nb, bs, INDEXER_HEAD_DIM)
    scales = flat[:, bs * INDEXER_HEAD_DIM :].view(torch.float32)
    return values, scales
