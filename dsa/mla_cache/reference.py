"""Plain PyTorch reference for writing and reading the MLA cache (SPEC.md "Caches" 1-2,
"Writing the MLA cache"). These functions define the semantics; the Triton kernels in
``kernel.py`` must reproduce their bytes exactly.

fp8 quantisation (shared with the indexer K cache): for every group of 128 values,
``scale = max(amax, 1e-4) / 448`` in fp32 (IEEE division), optionally rounded UP to a
power of two, and ``q = fp8_e4m3fn(clamp(x / scale, -448, 448))`` with round-to-nearest-even.

The power-of-two round-up is exact bit arithmetic on the fp32 scale (clear the mantissa,
carry into the exponent when it was non-zero), i.e. the mathematically exact
``2**ceil(log2(scale))``. FlashMLA's test quantiser computes ``2**ceil(log2(scale))`` with
float ``log2``; the two agree whenever that ``log2`` is exact, and ours never rounds a
scale just above a power of two down to it. The scale is always a normal fp32 number
(``>= 1e-4 / 448``), so the bit trick is valid. Inputs must be finite; what non-finite
inputs produce is unspecified.
"""
from __future__ import annotations

import torch

from ..constants import (
    D_QK,
    FP8_DS_MLA_GROUP,
    FP8_DS_MLA_NUM_GROUPS,
    FP8_DS_MLA_ROW_BYTES,
    KV_LORA_RANK,
)
from ..fp8 import pow2_ceil, quantize_fp8_groups  # noqa: F401  (pow2_ceil re-exported for tests)
from ..layouts import fp8_ds_mla_views

KV_FORMATS = ("bf16", "fp8_ds_mla")

def quantize_fp8_ds_mla(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack ``c_kv [T, 512]`` bf16 and ``k_pe [T, 64]`` bf16 into fp8_ds_mla rows ``[T, 656]`` uint8.

    Four power-of-two fp32 scales (one per 128 values of c_kv), fp8 e4m3fn values, k_pe verbatim.
    """
    t = c_kv.shape[0]
    rows = torch.empty(t, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=c_kv.device)
    values, scales, rope = fp8_ds_mla_views(rows)
    q, s = quantize_fp8_groups(c_kv, FP8_DS_MLA_GROUP, ue8m0=True)
    values.view(torch.uint8).copy_(q.view(torch.uint8))
    scales.copy_(s)
    rope.copy_(k_pe.to(torch.bfloat16))
    return rows


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """Read fp8_ds_mla rows ``[..., 656]`` uint8 back to ``[..., 576]`` bf16.

    ``value = bf16(float32(fp8) * scale)`` (one fp32 product, round to nearest even);
    the rope part is copied verbatim. Any positive fp32 scale is accepted.
    """
    values, scales, rope = fp8_ds_mla_views(rows)
    v = values.to(torch.float32) * scales.repeat_interleave(FP8_DS_MLA_GROUP, dim=-1)
    return torch.cat([v.to(torch.bfloat16), rope], dim=-1)


def mla_cache_rows(cache: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Flat ``[S, 576]`` bf16 / ``[S, 656]`` uint8 view of an MLA cache (paged or flat)."""
    width = D_QK if kv_format == "bf16" else FP8_DS_MLA_ROW_BYTES
    return cache.view(-1, width)


def concat_and_cache_mla_ref(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str = "bf16",
) -> None:
    """Write ``[c_kv | k_pe]`` of token ``t`` into cache slot ``slot_mapping[t]``, in place.

    Only the first ``slot_mapping.shape[0]`` tokens are used. Slots ``< 0`` (padding) and
    slots ``>= S`` (outside the cache) are skipped. With duplicate slots, which token's row
    lands is unspecified.
    """
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
    rows = mla_cache_rows(cache, kv_format)
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    keep = (slots >= 0) & (slots < rows.shape[0])
    ckv, kpe, dst = c_kv[:n][keep], k_pe[:n][keep], slots[keep]
    assert ckv.shape[-1] == KV_LORA_RANK and FP8_DS_MLA_NUM_GROUPS * FP8_DS_MLA_GROUP == KV_LORA_RANK
    if kv_format == "bf16":
        rows[dst] = torch.cat([ckv, kpe], dim=-1).to(torch.bfloat16)
    else:
        rows[dst] = quantize_fp8_ds_mla(ckv, kpe)
