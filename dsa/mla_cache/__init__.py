"""Writing and reading the MLA cache (SPEC.md "Caches" 1-2 and "Writing the MLA cache").

Public: ``concat_and_cache_mla``, ``quantize_fp8_ds_mla``, ``dequantize_fp8_ds_mla``.
"""
from __future__ import annotations

import torch

from .. import _replay, backend as _backend
from .._checks import check_block_size, check_same_device, check_tensor
from ..constants import D_QK, FP8_DS_MLA_ROW_BYTES, KV_LORA_RANK, ROPE_DIM
from . import reference as _ref
from .reference import KV_FORMATS, concat_and_cache_mla_ref

__all__ = [
    "concat_and_cache_mla",
    "quantize_fp8_ds_mla",
    "dequantize_fp8_ds_mla",
    "concat_and_cache_mla_ref",
    "KV_FORMATS",
]


def _check_inputs(c_kv, k_pe):
    check_tensor("c_kv", c_kv, dtype=torch.bfloat16, ndim=2, shape=[None, KV_LORA_RANK])
    check_tensor("k_pe", k_pe, dtype=torch.bfloat16, ndim=2, shape=[c_kv.shape[0], ROPE_DIM])


def _check_slot_mapping(slot_mapping, num_tokens: int):
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int64, torch.int32), ndim=1)
    if slot_mapping.shape[0] > num_tokens:
        raise ValueError(
            f"slot_mapping: expected at most {num_tokens} entries (the tokens of c_kv), got {slot_mapping.shape[0]}"
        )


def _check_cache(cache, kv_format) -> torch.Tensor:
    """Validate an MLA cache and return its flat ``[S, row]`` view."""
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
    if kv_format == "bf16":
        check_tensor("cache", cache, dtype=torch.bfloat16, ndim=(2, 3))
        width, forms = D_QK, f"[num_blocks, block_size, {D_QK}] or [num_slots, {D_QK}]"
    else:
        check_tensor("cache", cache, dtype=torch.uint8, ndim=(2, 3, 4))
        width = FP8_DS_MLA_ROW_BYTES
        forms = f"[num_blocks, block_size, {width}], [num_blocks, block_size, 1, {width}] or [num_slots, {width}]"
    if cache.shape[-1] != width or (cache.dim() == 4 and cache.shape[2] != 1):
        raise ValueError(f"cache: expected {forms} for kv_format={kv_format!r}, got {list(cache.shape)}")
    if cache.dim() >= 3:
        check_block_size("cache.shape[1] (block_size)", cache.shape[1])
    if not cache.is_contiguous():
        raise ValueError(f"cache: expected a contiguous tensor, got strides {cache.stride()}")
    return cache.view(-1, width)


@_replay.planned
def concat_and_cache_mla(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str = "bf16",
    *,
    backend: str | None = None,
) -> None:
    """Write ``[c_kv | k_pe]`` rows into the paged MLA cache, in place.

    Args:
        c_kv: ``[T, 512]`` bf16 (row stride free, last dim contiguous).
        k_pe: ``[T, 64]`` bf16.
        cache: ``kv_format="bf16"``: ``[num_blocks, block_size, 576]`` bf16 (or flat ``[S, 576]``);
            ``kv_format="fp8_ds_mla"``: ``[num_blocks, block_size, 656]`` or
            ``[num_blocks, block_size, 1, 656]`` uint8 (or flat ``[S, 656]``). Contiguous;
            block_size a power of two from 1 to 256.
        slot_mapping: ``[T']`` int64 (int32 accepted), ``T' <= T``: token ``t < T'`` goes to slot
            ``slot_mapping[t]`` (= block_id * block_size + offset); the other tokens are ignored
            (vLLM semantics). Slots ``< 0`` are skipped, and so are slots ``>= S`` (never written
            out of bounds). Duplicate slots: which row lands is unspecified.
        kv_format: ``"bf16"`` or ``"fp8_ds_mla"`` (656-byte rows: fp8 c_kv with four power-of-two
            fp32 scales, one per 128 values, then k_pe as bf16; see ``reference.py``).

    No host sync, no allocation; CUDA-graph safe.
    """
    _check_inputs(c_kv, k_pe)
    _check_slot_mapping(slot_mapping, c_kv.shape[0])
    rows = _check_cache(cache, kv_format)
    device = check_same_device(c_kv=c_kv, k_pe=k_pe, cache=cache, slot_mapping=slot_mapping)
    if _backend.resolve(backend, device) == "reference":
        concat_and_cache_mla_ref(c_kv, k_pe, cache, slot_mapping, kv_format)
        return
    from .kernel import mla_cache_write

    mla_cache_write(c_kv, k_pe, rows, slot_mapping, fp8=kv_format == "fp8_ds_mla")


@_replay.planned
def quantize_fp8_ds_mla(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Pack ``c_kv [T, 512]`` bf16 and ``k_pe [T, 64]`` bf16 into fp8_ds_mla rows ``[T, 656]`` uint8.

    Per 128 values of c_kv: ``scale = 2**ceil(log2(max(amax, 1e-4) / 448))`` (fp32, exact),
    values ``fp8_e4m3fn(clamp(x / scale, +-448))`` (round to nearest even); k_pe verbatim.
    ``out``: optional ``[T, 656]`` uint8 (row stride free) written instead of allocating.
    """
    _check_inputs(c_kv, k_pe)
    t = c_kv.shape[0]
    if out is not None:
        check_tensor("out", out, dtype=torch.uint8, shape=[t, FP8_DS_MLA_ROW_BYTES])
    device = check_same_device(c_kv=c_kv, k_pe=k_pe, out=out)
    if _backend.resolve(backend, device) == "reference":
        rows = _ref.quantize_fp8_ds_mla(c_kv, k_pe)
        return rows if out is None else out.copy_(rows)
    from .kernel import mla_cache_write

    if out is None:
        out = torch.empty(t, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=device)
    mla_cache_write(c_kv, k_pe, out, None, fp8=True)
    return out


@_replay.planned
def dequantize_fp8_ds_mla(
    rows: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Read fp8_ds_mla rows ``[..., 656]`` uint8 back to ``[..., 576]`` bf16.

    ``value = bf16(float32(fp8) * scale)`` (one fp32 product, round to nearest even; any positive
    fp32 scale is accepted), k_pe copied verbatim. ``rows`` may be a whole paged cache
    (``[nb, bs, 656]`` / ``[nb, bs, 1, 656]``) or any ``[..., 656]`` tensor whose leading dims
    flatten to one (a non-flattenable one is copied first). ``out``: optional
    ``[..., 576]`` bf16 of the same leading shape, contiguous.
    """
    check_tensor("rows", rows, dtype=torch.uint8)
    if rows.dim() < 1 or rows.shape[-1] != FP8_DS_MLA_ROW_BYTES:
        raise ValueError(f"rows: expected shape [..., {FP8_DS_MLA_ROW_BYTES}], got {list(rows.shape)}")
    out_shape = [*rows.shape[:-1], D_QK]
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=out_shape, contiguous=True)
    device = check_same_device(rows=rows, out=out)
    if _backend.resolve(backend, device) == "reference":
        res = _ref.dequantize_fp8_ds_mla(rows)
        return res if out is None else out.copy_(res)
    from .kernel import fp8_ds_mla_read

    if out is None:
        out = torch.empty(out_shape, dtype=torch.bfloat16, device=device)
    fp8_ds_mla_read(rows.reshape(-1, FP8_DS_MLA_ROW_BYTES), out.view(-1, D_QK))
    return out
