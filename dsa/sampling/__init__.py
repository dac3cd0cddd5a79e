"""Next-token choice from logits (greedy, or sampled with temperature and top-p), the same on every path:
:func:`dsa.model.generate`, the engine's eager steps and its CUDA-graph steps (inside the graph, so sampled decoding
runs ahead of the host like greedy decoding).

Public: :func:`sample_tokens`, :func:`row_seed`. Semantics: :mod:`dsa.sampling.reference`; design:
:mod:`dsa.sampling.kernel`.
"""
from __future__ import annotations

import torch

from .. import _checks
from ..backend import resolve
from .kernel import sample_launch
from .reference import (gumbel, inv_temperature, nucleus, nucleus_ref, row_seed, sample_tokens_ref, scaled_logits,
                        uniforms)

__all__ = ["sample_tokens", "row_seed", "sample_tokens_ref", "nucleus", "nucleus_ref", "uniforms", "gumbel",
           "scaled_logits"]


def sample_tokens(logits: torch.Tensor, seeds: torch.Tensor | None, temperature: float, top_p: float = 1.0, *,
                  out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """The next token of each row.

    Args:
        logits: ``[B, V]`` fp32, bf16 or fp16 (taken in fp32), the last dim contiguous (the rows may be any
            stride, 0 included); never NaN.
        seeds: ``[B]`` int64, contiguous, one per row (:func:`row_seed`), on the logits' device; unused (may be
            None) when greedy.
        temperature: ``<= 0``: greedy (``argmax``, the first index among equal maxima); else the draw's temperature.
        top_p: in (0, 1]: the nucleus' mass (1: the whole vocabulary).
        out: optional int64 ``[B]`` (contiguous) on the logits' device, written and returned.
        backend: ``None | "auto" | "triton" | "reference"`` (:mod:`dsa.backend`).

    Returns:
        int64 ``[B]`` on the logits' device (``out`` when given). No host synchronisation (capturable in a CUDA
        graph). The kernel and the reference give the same tokens but for rounding ties (:mod:`dsa.sampling.kernel`).
    """
    _checks.check_tensor("logits", logits, dtype=(torch.float32, torch.bfloat16, torch.float16), ndim=2)
    B, V = logits.shape
    if out is not None:
        _checks.check_tensor("out", out, dtype=torch.int64, shape=(B,), contiguous=True)
        _checks.check_same_device(logits=logits, out=out)
    if temperature <= 0:
        return torch.argmax(logits, dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)
    if isinstance(top_p, bool) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p!r}")
    if seeds is None:
        raise ValueError(f"seeds: expected an int64 tensor [{B}] (one seed per row) when sampling, got None")
    _checks.check_tensor("seeds", seeds, dtype=torch.int64, shape=(B,))
    _checks.check_same_device(logits=logits, seeds=seeds)
    if V == 0 or V >= 2**31:
        raise ValueError(f"logits: expected 1 to 2**31 - 1 vocabulary columns, got {V}")
    if resolve(backend, logits.device) == "reference":
        tok = sample_tokens_ref(logits, seeds, temperature, top_p)
        return tok if out is None else out.copy_(tok)
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    return sample_launch(logits, seeds, out, inv_temperature(temperature), float(top_p))
