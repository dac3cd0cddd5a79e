"""Sparse MLA attention over the paged MLA cache (SPEC.md "Sparse MLA attention")."""
from __future__ import annotations

import math

import torch

from .. import _replay
from .. import backend as _backend
from .._checks import check_same_device, check_tensor
from ..constants import D_QK, D_V, FP8_DS_MLA_ROW_BYTES
from .reference import flat_kv, sparse_mla_ref

__all__ = ["sparse_mla", "sparse_mla_ref"]

MAX_HEADS = 128
HEAD_MULTIPLE = 8


def _check_kv(kv) -> None:
    check_tensor("kv", kv, dtype=(torch.bfloat16, torch.uint8))
    width = D_QK if kv.dtype == torch.bfloat16 else FP8_DS_MLA_ROW_BYTES
    fmt = "bf16" if kv.dtype == torch.bfloat16 else "fp8_ds_mla uint8"
    shape = list(kv.shape)
    ok = (kv.dim() in (2, 3) and shape[-1] == width) or (kv.dim() == 4 and shape[2] == 1 and shape[-1] == width)
    if not ok:
        raise ValueError(
            f"kv: expected {fmt} [S, {width}], [num_blocks, block_size, {width}] or "
            f"[num_blocks, block_size, 1, {width}], got {shape}")
    if not kv.is_contiguous():
        raise ValueError(f"kv: expected a contiguous tensor, got strides {kv.stride()}")


@_replay.planned
def sparse_mla(q, kv, indices, sm_scale, d_v=D_V, attn_sink=None, topk_length=None, out=None, *, backend=None):
    """Sparse MLA attention of each query token over its own list of cache slots.

    Args:
        q: ``[T, h_q, 576]`` bf16, ``h_q`` a multiple of 8 up to 128 (the absorbed query
            ``[q_nope·W_UK (512) | q_pe (64)]``); last dim contiguous.
        kv: the MLA cache, bf16 ``[S, 576]`` / ``[num_blocks, block_size, 576]`` or fp8_ds_mla uint8
            ``[S, 656]`` / ``[num_blocks, block_size, 656]`` / ``[num_blocks, block_size, 1, 656]``
            (contiguous; S = num_blocks·block_size slots).
        indices: ``[T, topk]`` int32 global slots (topk >= 1). Entry j of row t is valid iff
            ``0 <= indices[t, j] < S`` and ``j < topk_length[t]``; invalid entries are skipped.
        sm_scale: softmax scale (a finite Python number > 0).
        d_v: 512 (V = the first 512 values of a cache row).
        attn_sink: optional ``[h_q]`` f32 per-head sink logit (adds ``exp(sink)`` to the denominator).
        topk_length: optional ``[T]`` int32 count of leading entries to use per row.
        out: optional ``[T, h_q, 512]`` bf16 (last dim contiguous) written in place and returned.
        backend: ``None`` / ``"auto"`` / ``"triton"`` / ``"reference"`` (see :mod:`dsa.backend`).

    Returns:
        ``(out [T, h_q, 512] bf16, max_logits [T, h_q] f32, lse [T, h_q] f32)`` with
        ``P_j = sm_scale · q·kv[idx_j, :576]`` (fp32), ``lse = logsumexp(P)`` (natural log, without the
        sink), ``max_logits = max(P)``, ``out = Σ_j exp(P_j − logaddexp(lse, sink))·kv[idx_j, :512]``.
        A (t, h) with no valid entry gives ``out = 0``, ``lse = +inf``, ``max_logits = -inf``
        (FlashMLA's convention). fp8 rows are dequantised to bf16 before the products.

    Eager calls on a GPU are replayed: the first call with a signature (shapes, strides, dtypes, devices, 16-byte
    alignment, the other arguments, the backend) is recorded, and later ones allocate and launch the same compiled
    kernels directly, without checking or deciding anything again (:func:`dsa._replay.planned`; ``DSA_PLANS=0``
    turns this off). The result is bitwise the same.

    No host–device synchronisation; CUDA-graph safe for fixed shapes (the split-K path allocates
    its fp32 partials with ``torch.empty``). The work split is chosen inside, and so is whether the index lists
    are first grouped by slot range into a ``[T, topk]`` int32 copy (many tokens over a large cache, for L2
    locality; :mod:`dsa.mla.order`): the result is the same up to the order of the fp32 sums. So is how the heads
    run: in programs of 16, 32 or 64 heads (8 heads in 16-head programs, the rest of a group masked), and on
    Hopper 72-96 heads in calls of many tokens as two calls, 64 heads and the rest (:func:`dsa.mla.kernel.slice_pays`),
    whichever measured faster (BENCHMARKS.md, thirty-seventh session). On Hopper, a call of many tokens with more
    than 16 heads over a fp8_ds_mla cache of at most 466K rows (with enough entries per cache row) first dequantises
    the whole cache into a bf16 copy (``torch.empty``, at most 512 MiB) and runs on that: the same bf16 values, so
    the result differs only in the order of the fp32 sums (:func:`dsa.mla.kernel.dequant_first_pays`; BENCHMARKS.md,
    fifty-third to fifty-fifth sessions). Over a larger cache (an engine's pool), such a call with at least 131072
    tokens x heads copies only the pages its index lists read, with the lists remapped onto the copy
    (:mod:`dsa.mla.compact`), into a copy allocated at the rule's bound (``torch.empty``, at most 512 MiB); the
    pages' count stays on the device, where a flag picks the kernels over the copy or those over the cache (both are
    queued; the other returns at once).
    """
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T, h_q, d_qk = q.shape
    if d_qk != D_QK:
        raise ValueError(f"q: expected last dim (d_qk) {D_QK}, got {d_qk} (shape {list(q.shape)})")
    if h_q <= 0 or h_q % HEAD_MULTIPLE or h_q > MAX_HEADS:
        raise ValueError(f"q: expected h_q (dim 1) a multiple of {HEAD_MULTIPLE} from {HEAD_MULTIPLE} to {MAX_HEADS}, "
                         f"got h_q={h_q}")
    _check_kv(kv)
    check_tensor("indices", indices, dtype=torch.int32, ndim=2)
    if indices.shape[0] != T:
        raise ValueError(f"indices: expected shape [{T}, topk] (T from q), got {list(indices.shape)}")
    if indices.shape[1] < 1:
        raise ValueError(f"indices: expected topk (dim 1) >= 1, got {indices.shape[1]}")
    if isinstance(sm_scale, (torch.Tensor, bool)) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale: expected a Python float, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:  # NaN or inf logits would ruin every row's softmax
        raise ValueError(f"sm_scale: expected a finite number > 0, got {sm_scale!r}")
    if isinstance(d_v, bool) or d_v != D_V:
        raise ValueError(f"d_v: expected {D_V}, got {d_v!r}")
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=[h_q], contiguous=True)
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=[T], contiguous=True)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=[T, h_q, D_V])
    dev = check_same_device(q=q, kv=kv, indices=indices, attn_sink=attn_sink, topk_length=topk_length, out=out)

    kv_flat = flat_kv(kv)
    if _backend.resolve(backend, dev) == "reference":
        o, ml, lse = sparse_mla_ref(q, kv_flat, indices, float(sm_scale), d_v, attn_sink, topk_length)
        if out is not None:
            out.copy_(o)
            o = out
        return o, ml, lse
    from .kernel import sparse_mla_triton

    return sparse_mla_triton(q, kv_flat, indices, float(sm_scale), d_v, attn_sink, topk_length, out)
