"""Lightning-indexer query/key preparation (SPEC.md "Model dimensions", "Layers and model").

* :func:`prepare_indexer_q`: RoPE on the first 64 dims of each of the 64 heads,
  optional Hadamard rotation, fp8 e4m3fn quantisation with one scale per
  (token, head), the scale folded into the head weights
  (``weights * q_scale * 128**-0.5 * 64**-0.5``) -- ready for ``fp8_mqa_logits``.
* :func:`prepare_indexer_k`: RoPE (and Hadamard) on the indexer key in place,
  ready for ``indexer_k_quant_and_cache``.

The references (``*_ref``, :func:`hadamard_128`, :func:`apply_rope_ref`) live in
``dsa.indexer_prep.reference`` and document the exact computation order.
"""
from __future__ import annotations

import torch

from .. import _checks, _replay
from ..backend import resolve
from ..constants import INDEXER_HEAD_DIM, INDEXER_NUM_HEADS, INDEXER_ROPE_DIM
from .reference import (
    SCALE_FMTS,
    apply_rope_ref,
    hadamard_128,
    hadamard_matrix,
    prepare_indexer_k_ref,
    prepare_indexer_q_ref,
)

__all__ = [
    "prepare_indexer_q",
    "prepare_indexer_k",
    "hadamard_128",
    "hadamard_matrix",
    "apply_rope_ref",
    "prepare_indexer_q_ref",
    "prepare_indexer_k_ref",
]

_ROPE_HALF = INDEXER_ROPE_DIM // 2
_FLOATS = (torch.float32, torch.bfloat16)


def _check_flag(name, v):
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")


def _check_rope(T, cos, sin, interleaved, hadamard):
    _checks.check_tensor("cos", cos, dtype=_FLOATS, shape=(T, _ROPE_HALF))
    _checks.check_tensor("sin", sin, dtype=_FLOATS, shape=(T, _ROPE_HALF))
    _check_flag("interleaved", interleaved)
    _check_flag("hadamard", hadamard)


@_replay.planned
def prepare_indexer_q(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: torch.Tensor,
    *,
    interleaved: bool = False,
    hadamard: bool = False,
    scale_fmt: str | None = "ue8m0",
    return_scale: bool = False,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
):
    """Fused indexer-query preparation: RoPE -> (Hadamard) -> fp8 quant, scale folded into weights.

    Args:
        q: ``[T, 64, 128]`` bf16 (last dim contiguous; other strides free), ``wq_b(q_lora)`` per head.
        cos, sin: ``[T, 32]`` float32 or bf16 (last dim contiguous), the rotary table rows of each
            token's position (pair ``i`` uses column ``i``).
        weights: ``[T, 64]`` float32 or bf16 (any strides), ``weights_proj(x)``.
        interleaved: rope pairs ``(2i, 2i+1)`` (GPT-J, GLM-5's ``indexer_rope_interleave``) instead of
            rotate-half pairs ``(i, i+32)`` (NeoX, DeepSeek-V3.2).
        hadamard: rotate each head by the normalised 128-point Walsh-Hadamard transform after RoPE
            (apply it to k too: :func:`prepare_indexer_k`).
        scale_fmt: ``"ue8m0"`` (scale rounded up to a power of two) or ``None`` (plain fp32 scale).
        return_scale: also return ``q_scale [T, 64]`` float32.
        out: optional ``(q_fp8 [T, 64, 128] float8_e4m3fn, weights_out [T, 64] float32)``, last dims contiguous.
        backend: ``None | "auto" | "triton" | "reference"``.

    Per (token, head), with ``y`` the rotated row in fp32 (see ``reference.py`` for the exact
    order): ``q_scale = max(max|y|, 1e-4) / 448`` (rounded up to a power of two for ue8m0),
    ``q_fp8 = e4m3fn(y / q_scale)``, ``weights_out = weights * q_scale * 128**-0.5 * 64**-0.5``.

    Returns ``(q_fp8, weights_out)`` (plus ``q_scale`` when ``return_scale``). No host sync;
    CUDA-graph safe for fixed shapes.
    """
    _checks.check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T = q.shape[0]
    _checks.check_tensor("q", q, shape=(T, INDEXER_NUM_HEADS, INDEXER_HEAD_DIM))
    _check_rope(T, cos, sin, interleaved, hadamard)
    _checks.check_tensor("weights", weights, dtype=_FLOATS, shape=(T, INDEXER_NUM_HEADS), last_dim_contiguous=False)
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt: expected one of {SCALE_FMTS}, got {scale_fmt!r}")
    _check_flag("return_scale", return_scale)
    q_out = w_out = None
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"out: expected a tuple (q_fp8, weights_out), got {type(out).__name__}")
        q_out, w_out = out
        _checks.check_tensor("out[0]", q_out, dtype=torch.float8_e4m3fn, shape=tuple(q.shape))
        _checks.check_tensor("out[1]", w_out, dtype=torch.float32, shape=(T, INDEXER_NUM_HEADS))
    device = _checks.check_same_device(q=q, cos=cos, sin=sin, weights=weights, out_q=q_out, out_weights=w_out)

    if resolve(backend, device) == "reference":
        qf, wf, sf = prepare_indexer_q_ref(q, cos, sin, weights, interleaved=interleaved, hadamard=hadamard,
                                           scale_fmt=scale_fmt)
        if q_out is not None:
            q_out.copy_(qf)
            w_out.copy_(wf)
            qf, wf = q_out, w_out
        return (qf, wf, sf) if return_scale else (qf, wf)

    from .kernel import prepare_indexer_q_triton

    if q_out is None:
        q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=device)
        w_out = torch.empty((T, INDEXER_NUM_HEADS), dtype=torch.float32, device=device)
    s_out = torch.empty((T, INDEXER_NUM_HEADS), dtype=torch.float32, device=device) if return_scale else None
    prepare_indexer_q_triton(q, cos, sin, weights, q_out, w_out, s_out, interleaved=interleaved, hadamard=hadamard,
                             scale_fmt=scale_fmt)
    return (q_out, w_out, s_out) if return_scale else (q_out, w_out)


@_replay.planned
def prepare_indexer_k(
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    hadamard: bool = False,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Indexer-key preparation: RoPE on the first 64 dims (and the Hadamard rotation), in place.

    Args:
        k: ``[T, 128]`` bf16 (last dim contiguous), the LayerNorm-ed ``wk(x)``.
        cos, sin: ``[T, 32]`` float32 or bf16, as for :func:`prepare_indexer_q`.
        interleaved, hadamard: as for :func:`prepare_indexer_q` (use the same values for q and k).
        out: where to write ``[T, 128]`` bf16; default ``k`` itself (in place).
        backend: ``None | "auto" | "triton" | "reference"``.

    Computed in fp32 and rounded once to bf16. Returns ``out`` (``k`` by default), ready for
    ``indexer_k_quant_and_cache``. No host sync; CUDA-graph safe.
    """
    _checks.check_tensor("k", k, dtype=torch.bfloat16, ndim=2)
    T = k.shape[0]
    _checks.check_tensor("k", k, shape=(T, INDEXER_HEAD_DIM))
    _check_rope(T, cos, sin, interleaved, hadamard)
    if out is not None:
        _checks.check_tensor("out", out, dtype=torch.bfloat16, shape=(T, INDEXER_HEAD_DIM))
    device = _checks.check_same_device(k=k, cos=cos, sin=sin, out=out)
    if out is None:
        out = k

    if resolve(backend, device) == "reference":
        return out.copy_(prepare_indexer_k_ref(k, cos, sin, interleaved=interleaved, hadamard=hadamard))

    from .kernel import prepare_indexer_k_triton

    prepare_indexer_k_triton(k, cos, sin, out, interleaved=interleaved, hadamard=hadamard)
    return out
