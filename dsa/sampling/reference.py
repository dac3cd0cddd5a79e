"""Plain PyTorch reference for next-token choice (:func:`dsa.sampling.sample_tokens`): this file defines the
semantics; the Triton kernel (``kernel.py``) picks the same tokens.

* Greedy (``temperature <= 0``): ``argmax(logits)`` (the first index among equal maxima).
* Sampled: with ``z = logits * fp32(1 / temperature)`` in fp32 (:func:`scaled_logits`), a draw from
  ``softmax(z)`` restricted to the top-``top_p`` nucleus, by the Gumbel-max trick: ``argmax(z + g)`` over the
  nucleus, with ``g = -log(-log(u))`` and ``u`` uniform in (0, 1). The nucleus (:func:`nucleus`): in descending
  order of ``z``, equal logits by index, the tokens whose preceding mass under ``softmax(z)`` is below ``top_p``;
  the first token always stays.

``u`` is not drawn from a generator's stream: it is a hash of the row's seed and the vocabulary index
(:func:`uniforms`). The engine and :func:`dsa.model.generate` give each sampled token the seed :func:`row_seed`
``(seed, request, k)`` (its ``k``-th new token), so a request's tokens depend only on its own logits and these three
numbers, never on which other requests share its steps, on their order, or on whether the step ran eagerly, as a
CUDA graph, or ahead of the host. Everything here is plain torch ops (capturable in a CUDA graph).
"""
from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
#: the hash's multipliers: both below 2**31, so that a 32-bit value times either stays below 2**63 (no int64 overflow)
_M1, _M2 = 0x7FEB352D, 0x5BD1E995
_MASK63 = (1 << 63) - 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def row_seed(seed: int, request: int, k: int) -> int:
    """The seed of the ``k``-th new token of request ``request`` under the run's ``seed`` (in [0, 2**63))."""
    return _splitmix64(_splitmix64(_splitmix64(int(seed)) ^ int(request)) ^ int(k)) & _MASK63


#: the uniforms' resolution: ``u = (top 23 bits of the hash + 0.5) / 2**23``, exact in fp32, so ``u`` lies in
#: [2**-24, 1 - 2**-24] and ``g = -log(-log(u))`` is finite (at most about 16.6). (With 24 bits, ``2**24 - 0.5``
#: rounds to 2**24 in fp32: ``u = 1`` and ``g = +inf``, a token drawn whatever its probability.)
U_BITS = 23


def uniform_of_hash(h: torch.Tensor) -> torch.Tensor:
    """fp32 ``u`` in (0, 1) from 32-bit hashes ``h`` (int64 in [0, 2**32)): see :data:`U_BITS`."""
    return ((h >> (32 - U_BITS)).to(torch.float32) + 0.5) * (1.0 / (1 << U_BITS))


def uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u [B, vocab]`` fp32 in (0, 1) from a hash of (``seeds [B]`` int64, the vocabulary index)."""
    s = seeds.to(torch.int64)[:, None]
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    return uniform_of_hash(_mix32(_mix32(v ^ ((s >> 32) & _MASK32)) ^ (s & _MASK32)))


def gumbel(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``g = -log(-log(u)) [B, vocab]`` fp32 (:func:`uniforms`), the Gumbel noise of each token."""
    return -torch.log(-torch.log(uniforms(seeds, vocab)))


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``z = logits * fp32(1 / temperature)`` in fp32 (one IEEE product per element, as the kernel computes it), with
    ``-0.0`` made ``+0.0`` (so that the two zeros are equal logits for the order below)."""
    z = logits.float() * inv_temperature(temperature)
    return torch.where(z == 0, 0.0, z)


def inv_temperature(temperature: float) -> float:
    """``1 / temperature`` rounded to fp32 (the factor both the reference and the kernel scale the logits by)."""
    return float(np.float32(1.0 / temperature))


def sample_tokens_ref(logits: torch.Tensor, seeds: torch.Tensor | None, temperature: float, top_p: float = 1.0
                      ) -> torch.Tensor:
    """The next token of each row (see the module's docstring); arguments as :func:`dsa.sampling.sample_tokens`."""
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    z = scaled_logits(logits, temperature)
    if top_p < 1.0:
        z = z.masked_fill(~nucleus(z, top_p), float("-inf"))
    return torch.argmax(z + gumbel(seeds, z.shape[1]), dim=-1)


def _descending_keys(z: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) that sort fp32 ``z`` in descending order (the float's bits made order-preserving as
    a signed integer, then reversed)."""
    b = z.contiguous().view(torch.int32).to(torch.int64)
    return 0x7FFFFFFF - torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def nucleus(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-``top_p`` nucleus of each row of scaled logits ``z [B, V]`` fp32 (from :func:`scaled_logits`), as a
    bool mask: in descending order of ``z`` (equal logits by index), the tokens whose preceding mass under
    ``softmax(z)`` is below ``top_p`` (the first always).

    The order comes from one sort of the whole batch as 1-D int64 keys (row, then the logit's bits made
    order-preserving), in place of PyTorch's segmented sort of the rows as ``[B, V]``."""
    B, V = z.shape
    p = torch.softmax(z, dim=-1)
    rows = torch.arange(B, dtype=torch.int64, device=z.device)[:, None]
    order = torch.sort(((rows << 32) | _descending_keys(z)).reshape(-1), stable=True).indices
    sp = p.reshape(-1)[order].view(B, V)
    keep = (torch.cumsum(sp, dim=-1) - sp) < top_p
    keep[:, 0] = True  # (the most likely token, whatever the rounding of the sums)
    return torch.zeros(B * V, dtype=torch.bool, device=z.device).scatter_(0, order, keep.reshape(-1)).view(B, V)


def nucleus_ref(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`nucleus`'s rule written out row by row (its meaning, for tests and benchmarks): a stable descending
    sort of each row of ``z``, the tokens whose preceding mass under ``softmax(z)`` is below ``top_p``, the first
    always."""
    sz, si = torch.sort(z, dim=-1, descending=True, stable=True)
    sp = torch.softmax(z, dim=-1).gather(1, si)
    keep = (torch.cumsum(sp, dim=-1) - sp) < top_p
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, si, keep)


__all__ = ["sample_tokens_ref", "scaled_logits", "inv_temperature", "row_seed", "uniforms", "gumbel",
           "uniform_of_hash", "U_BITS", "nucleus", "nucleus_ref"]
