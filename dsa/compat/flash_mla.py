"""FlashMLA's sparse attention entry points (``flash_mla_interface.py``) on :func:`dsa.sparse_mla`.

``from dsa.compat import flash_mla`` gives code written for FlashMLA's DeepSeek-V3.2 sparse kernels the same calls
on any GPU Triton runs on. Same as FlashMLA: names, argument order, shapes, the fp8 cache's 656-byte rows (also as a
``float8_e4m3fn`` tensor), invalid indices (negative, or past the cache), ``topk_length``, ``attn_sink`` (including
±inf), and results (``lse`` in natural log, ``+inf`` and a zero output where a query has no valid entry).

Differences, decided here:

* every head count FlashMLA's users run at TP 1-16 works (``h_q`` a multiple of 8 up to 128; FlashMLA takes 64 and
  128 only);
* ``flash_mla_with_kvcache`` also reads a bf16 cache ``[num_blocks, block_size, 1, 576]`` (``is_fp8_kvcache=False``);
* the scheduling metadata is a placeholder: dsa chooses the work split inside each call, so one
  :class:`FlashMLASchedMeta` may serve calls of any shape, and ``tile_scheduler_metadata`` / ``num_splits`` are not
  read (the two tensors of FlashMLA's older ``get_mla_metadata`` may be passed);
* the decode ``lse`` ``[b, h_q, s_q]`` is a transposed view of a ``[b, s_q, h_q]`` tensor (no copy kernel; call
  ``.contiguous()`` where a packed one is needed);
* a decode cache with padded blocks (FlashMLA reads any block stride) is taken when the stride is a whole number of
  rows: the index lists are mapped onto a flat view of the rows first (a few elementwise ops on them);
* not taken (``ValueError`` naming the argument): dense decode (``indices=None``), ``causal``, the extra cache and
  its indices (DeepSeek-V4's second index list), ``indexer_topk``, and a block stride that is not a whole number of
  rows.
"""
from __future__ import annotations

import torch

from .._checks import check_tensor
from ..constants import D_V, INT32_MAX
from ..mla import sparse_mla

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd"]


class FlashMLASchedMeta:
    """Placeholder for FlashMLA's tile-scheduler metadata: dsa's calls need none (each chooses its own split)."""

    have_initialized = False
    tile_scheduler_metadata = None
    num_splits = None


def get_mla_metadata(*args, **kwargs):
    """FlashMLA's ``get_mla_metadata``: ``(FlashMLASchedMeta(), None)``, whatever the arguments (as FlashMLA's
    current interface, which also ignores them)."""
    return FlashMLASchedMeta(), None


def _not_taken(name: str, value, why: str) -> None:
    if value is not None:
        raise ValueError(f"{name}: not supported by dsa ({why}); expected None, got {type(value).__name__}")


def _cache_rows(k_cache, is_fp8_kvcache, indices):
    """The MLA cache as dsa's ``kv`` argument and the index lists ``[T, topk]`` that go with it.

    An fp8 cache becomes uint8 bytes (a view), after checking the format flag. A cache whose blocks are padded
    (block stride a whole number of rows, more than ``block_size``: FlashMLA's allowance, e.g. a page padded to
    another cache's size) becomes one flat view of its rows, padding rows included, and each valid slot
    ``b * block_size + i`` its row ``b * rows_per_block + i`` there (invalid ones -1): a few elementwise ops on the
    indices, no copy of the cache; the padding is never read."""
    check_tensor("k_cache", k_cache, dtype=(torch.uint8, torch.float8_e4m3fn, torch.bfloat16), ndim=(3, 4))
    fp8 = k_cache.dtype != torch.bfloat16
    if bool(is_fp8_kvcache) != fp8:
        raise ValueError(f"is_fp8_kvcache: {is_fp8_kvcache} does not match k_cache's dtype "
                         f"{str(k_cache.dtype).replace('torch.', '')} (fp8_ds_mla rows are uint8 or float8_e4m3fn "
                         "bytes, 656 per token; a bf16 cache has 576 values per token)")
    if k_cache.dim() == 4 and k_cache.shape[2] != 1:
        raise ValueError(f"k_cache: expected num_heads_k (dim 2) 1, got shape {list(k_cache.shape)}")
    if k_cache.dtype == torch.float8_e4m3fn:
        k_cache = k_cache.view(torch.uint8)
    if k_cache.is_contiguous():
        return k_cache, indices
    nb, bs, width = k_cache.shape[0], k_cache.shape[1], k_cache.shape[-1]
    rows_per_block = k_cache.stride(0) // width if nb > 1 else bs
    packed = (bs == 1 or k_cache.stride(1) == width) and k_cache.stride(-1) == 1
    if not (packed and k_cache.stride(0) % width == 0 and rows_per_block >= bs):
        raise ValueError(f"k_cache: expected contiguous rows within each block and a block stride of a whole number "
                         f"of rows ({width} elements, at least block_size of them), got shape {list(k_cache.shape)} "
                         f"with strides {k_cache.stride()}")
    S, rows = nb * bs, max(nb - 1, 0) * rows_per_block + bs
    if rows > INT32_MAX:
        raise ValueError(f"k_cache: {rows} rows with the padding exceed int32 slots")
    flat = torch.as_strided(k_cache, (rows, width), (width, 1), k_cache.storage_offset())
    idx = indices.long()
    row = idx + (idx // bs) * (rows_per_block - bs)
    return flat, torch.where((idx >= 0) & (idx < S), row, -1).to(torch.int32)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata=None,
    num_splits=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    *,
    backend: str | None = None,
):
    """FlashMLA's sparse decode: every query token attends to its own list of cache slots.

    Args:
        q: ``[b, s_q, h_q, 576]`` bf16.
        k_cache: the MLA cache, ``[num_blocks, block_size, 1, 656]`` fp8_ds_mla bytes (uint8 or float8_e4m3fn;
            ``is_fp8_kvcache=True``) or ``[num_blocks, block_size, 1, 576]`` bf16; rows contiguous within a block,
            blocks one after the other or a whole number of rows apart.
        block_table, cache_seqlens: not read (the indices are slots already, as in FlashMLA's sparse mode).
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: not read (FlashMLA's current interface passes the metadata of
            :func:`get_mla_metadata` and None; the older one's two tensors are accepted too).
        softmax_scale: default ``576 ** -0.5``, as FlashMLA's.
        causal: False.
        indices: ``[b, s_q, topk]`` int32 slots ``block_id * block_size + offset``; negative or past the cache:
            skipped.
        attn_sink: optional ``[h_q]`` f32; the output is scaled by ``exp(lse) / (exp(lse) + exp(attn_sink))``.
        topk_length: optional ``[b]`` int32: each token of request i uses its first ``topk_length[i]`` entries.
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length: None.
        backend: dsa's backend choice (keyword only; see :mod:`dsa.backend`).

    Returns:
        ``(out [b, s_q, h_q, 512] bf16, lse [b, h_q, s_q] f32)``.
    """
    if indices is None:
        raise ValueError("indices: dsa provides the sparse form of flash_mla_with_kvcache only; expected the "
                         "[b, s_q, topk] int32 slot lists, got None (dense decode)")
    if not isinstance(causal, bool) or causal:
        raise ValueError(f"causal: expected False with sparse indices (as FlashMLA), got {causal!r}")
    why = "a second index list over an extra cache, DeepSeek-V4's form"
    _not_taken("extra_k_cache", extra_k_cache, why)
    _not_taken("extra_indices_in_kvcache", extra_indices_in_kvcache, why)
    _not_taken("extra_topk_length", extra_topk_length, why)
    check_tensor("q", q, dtype=torch.bfloat16, ndim=4)
    b, s_q, h_q, d_qk = q.shape
    check_tensor("indices", indices, dtype=torch.int32, ndim=3)
    if list(indices.shape[:2]) != [b, s_q]:
        raise ValueError(f"indices: expected shape [{b}, {s_q}, topk] (b, s_q from q), got {list(indices.shape)}")
    kv, indices = _cache_rows(k_cache, is_fp8_kvcache, indices.reshape(b * s_q, indices.shape[2]))
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=[b])
        topk_length = topk_length[:, None].expand(b, s_q).contiguous().view(b * s_q)  # one per token
    if softmax_scale is None:
        softmax_scale = d_qk ** -0.5
    out, _, lse = sparse_mla(q.reshape(b * s_q, h_q, d_qk), kv, indices, softmax_scale, head_dim_v,
                             attn_sink=attn_sink, topk_length=topk_length, backend=backend)
    return out.reshape(b, s_q, h_q, out.shape[-1]), lse.reshape(b, s_q, h_q).transpose(1, 2)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    indexer_topk: int = 0,
    *,
    backend: str | None = None,
):
    """FlashMLA's sparse prefill over a bf16 cache.

    Args:
        q: ``[s_q, h_q, 576]`` bf16.
        kv: ``[s_kv, 1, 576]`` bf16 (``[s_kv, 576]`` accepted), contiguous.
        indices: ``[s_q, 1, topk]`` int32 (``[s_q, topk]`` accepted); negative or ``>= s_kv``: skipped.
        sm_scale: the softmax scale.
        d_v: 512.
        attn_sink: optional ``[h_q]`` f32 (no effect on ``lse`` and ``max_logits``).
        topk_length: optional ``[s_q]`` int32.
        indexer_topk: 0.
        backend: dsa's backend choice (keyword only).

    Returns:
        ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q] f32, lse [s_q, h_q] f32)``.
    """
    if isinstance(indexer_topk, bool) or indexer_topk != 0:
        raise ValueError(f"indexer_topk: not supported by dsa (the lse over the indexer's part of the list); "
                         f"expected 0, got {indexer_topk!r}")
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=(2, 3))
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"kv: expected h_kv (dim 1) 1, got shape {list(kv.shape)}")
        kv = kv.squeeze(1)
    check_tensor("indices", indices, dtype=torch.int32, ndim=(2, 3))
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices: expected h_kv (dim 1) 1, got shape {list(indices.shape)}")
        indices = indices.squeeze(1)
    return sparse_mla(q, kv, indices, sm_scale, d_v, attn_sink=attn_sink, topk_length=topk_length, backend=backend)
