"""Plain PyTorch references for the lightning indexer's query/key preparation.

SPEC.md "Model dimensions" and "Layers and model": RoPE on the FIRST 64 of the
128 dims of each indexer head (rotate-half / NeoX by default, interleaved /
GPT-J on request), an optional Hadamard rotation applied to both q and k, then
for q an fp8 e4m3fn quantisation with one scale per (token, head) folded into
the head weights.

The computation order is fixed, and the Triton kernel follows it step by step:

1. ``x = q.float()`` (or ``k.float()``); ``cos``, ``sin`` as float32.
2. RoPE in fp32 on dims ``[0, 64)``: with ``(a, b)`` a rotated pair (``(i, i+32)``
   rotate-half, ``(2i, 2i+1)`` interleaved), ``a' = a*cos - b*sin`` and
   ``b' = b*cos + a*sin``, each product and sum rounded separately (no FMA).
3. Hadamard (optional): ``y = (bf16(x) @ H) * fp32(128**-0.5)`` with ``H`` the 128x128
   Sylvester ±1 matrix. The rope output is rounded to bf16 first (as the model does,
   where RoPE writes bf16) so the product can run on bf16 tensor cores; every
   product is exact, the sum is fp32.
4. k: ``bf16(y)``.
   q: ``amax = max|y|`` over the 128 dims of a (token, head);
   ``scale = max(amax, 1e-4) / 448`` (IEEE division), rounded up to a power of two
   for ``scale_fmt="ue8m0"`` (exactly, on the bits); ``q_fp8 = e4m3fn(clamp(y / scale, ±448))``;
   ``weights_out = weights.float() * scale * fp32(128**-0.5) * fp32(64**-0.5)``, left to right.
"""
from __future__ import annotations

import functools

import torch

from ..constants import INDEXER_HEAD_DIM, INDEXER_NUM_HEADS, INDEXER_ROPE_DIM
from ..fp8 import quantize_fp8_groups

SCALE_FMTS = ("ue8m0", None)
# 128**-0.5 and 64**-0.5 as the fp32 numbers every implementation multiplies by
SOFTMAX_SCALE = INDEXER_HEAD_DIM**-0.5
HEAD_SCALE = INDEXER_NUM_HEADS**-0.5
HADAMARD_SCALE = INDEXER_HEAD_DIM**-0.5


@functools.lru_cache(maxsize=None)
def _sylvester_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int = INDEXER_HEAD_DIM, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix of ±1 (``H[i, j] = (-1)**popcount(i & j)``), unnormalised."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    return _sylvester_cpu(n).to(dtype=dtype, device=device)


def hadamard_128(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform over the last dim (128): ``x @ H / sqrt(128)``.

    Computed as ``(x @ H) * 128**-0.5`` in fp32 (fp64 for fp64 input); returns ``x.dtype``.
    The transform is orthonormal and symmetric, so applying it twice gives back ``x``.
    """
    if x.shape[-1] != INDEXER_HEAD_DIM:
        raise ValueError(f"x: expected last dim {INDEXER_HEAD_DIM}, got {list(x.shape)}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard_matrix(INDEXER_HEAD_DIM, dtype=cdt, device=x.device)
    y = (x.to(cdt) @ h) * torch.tensor(HADAMARD_SCALE, dtype=cdt, device=x.device)
    return y.to(x.dtype)


def apply_rope_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rope_dim: int = INDEXER_ROPE_DIM,
    interleaved: bool = False,
) -> torch.Tensor:
    """RoPE on the FIRST ``rope_dim`` dims of ``x [T, ..., D]`` (the rest pass through).

    cos, sin: ``[T, rope_dim // 2]`` (one row per token, already gathered by position).
    ``interleaved=False``: rotate-half / NeoX, pairs ``(i, i + rope_dim/2)``;
    ``interleaved=True``: GPT-J, pairs ``(2i, 2i+1)``. Pair ``i`` uses ``cos[:, i]``, ``sin[:, i]``.
    Computed in fp32 (fp64 for fp64 input), each operation rounded separately; returns fp32
    (fp64) — callers round.
    """
    half = rope_dim // 2
    if rope_dim % 2 or rope_dim > x.shape[-1]:
        raise ValueError(f"rope_dim: expected an even number <= {x.shape[-1]}, got {rope_dim}")
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.to(cdt)
    # broadcast [T, half] over the middle (head) dims
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c = cos.to(cdt).reshape(shape)
    s = sin.to(cdt).reshape(shape)
    rot, rest = x[..., :rope_dim], x[..., rope_dim:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., :half], rot[..., half:]
    a2 = a * c - b * s
    b2 = b * c + a * s
    if interleaved:
        rot2 = torch.stack([a2, b2], dim=-1).flatten(-2)
    else:
        rot2 = torch.cat([a2, b2], dim=-1)
    return torch.cat([rot2, rest], dim=-1)


def _rotate(x, cos, sin, interleaved, hadamard):
    """Steps 1-3 of the module docstring: fp32 result."""
    y = apply_rope_ref(x.float(), cos, sin, INDEXER_ROPE_DIM, interleaved)
    if hadamard:
        h = hadamard_matrix(INDEXER_HEAD_DIM, dtype=torch.float32, device=x.device)
        y = (y.to(torch.bfloat16).float() @ h) * torch.tensor(HADAMARD_SCALE, dtype=torch.float32, device=x.device)
    return y


def prepare_indexer_q_ref(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: torch.Tensor,
    *,
    interleaved: bool = False,
    hadamard: bool = False,
    scale_fmt: str | None = "ue8m0",
):
    """Reference of :func:`dsa.indexer_prep.prepare_indexer_q`.

    q ``[T, 64, 128]`` bf16, cos/sin ``[T, 32]``, weights ``[T, 64]`` f32/bf16.
    Returns ``(q_fp8 [T, 64, 128] float8_e4m3fn, weights_out [T, 64] f32, q_scale [T, 64] f32)``.
    """
    y = _rotate(q, cos, sin, interleaved, hadamard)  # [T, H, 128] fp32
    q_fp8, scale = quantize_fp8_groups(y, INDEXER_HEAD_DIM, ue8m0=scale_fmt == "ue8m0")
    scale = scale.squeeze(-1)  # one scale per (token, head)
    f32 = dict(dtype=torch.float32, device=q.device)
    w = weights.float() * scale * torch.tensor(SOFTMAX_SCALE, **f32) * torch.tensor(HEAD_SCALE, **f32)
    return q_fp8, w, scale


def prepare_indexer_k_ref(
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = False,
    hadamard: bool = False,
) -> torch.Tensor:
    """Reference of :func:`dsa.indexer_prep.prepare_indexer_k`: returns a new ``[T, 128]`` bf16 tensor."""
    return _rotate(k, cos, sin, interleaved, hadamard).to(torch.bfloat16)
