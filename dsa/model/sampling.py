"""Next-token choice from fp32 logits, the same on every path: :func:`dsa.model.generate`, the engine's eager steps and
its CUDA-graph steps (inside the graph, so sampled decoding can run ahead of the host like greedy decoding).

* Greedy (``temperature <= 0``): ``argmax`` (the first index among equal maxima).
* Sampled: a draw from ``softmax(logits / temperature)`` restricted to the top-``top_p`` nucleus (the tokens, in
  descending probability, whose preceding mass is below ``top_p``: the most likely one always stays), by the
  Gumbel-max trick: ``argmax(logits / temperature + g)`` over the nucleus, with ``g = -log(-log(u))`` and ``u``
  uniform in (0, 1).

``u`` is not drawn from a generator's stream: it is a hash of the row's seed and the vocabulary index. The engine
gives each sampled token the seed :func:`row_seed` ``(seed, request, k)`` (its ``k``-th new token), so a request's
tokens depend only on its own logits and these three numbers, never on which other requests share its steps, on
their order, or on whether the step ran eagerly, as a CUDA graph, or ahead of the host. Everything is plain torch
ops on the logits' device (capturable in a CUDA graph).
"""
from __future__ import annotations

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


def uniforms(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """``u [B, vocab]`` fp32 in (0, 1): 24 bits of a hash of (``seeds [B]`` int64, the vocabulary index)."""
    s = seeds.to(torch.int64)[:, None]
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    h = _mix32(_mix32(v ^ ((s >> 32) & _MASK32)) ^ (s & _MASK32))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_tokens(logits: torch.Tensor, seeds: torch.Tensor | None, temperature: float, top_p: float = 1.0
                  ) -> torch.Tensor:
    """The next token of each row (see the module's docstring).

    ``logits [B, V]`` (any float dtype; taken in fp32), ``seeds [B]`` int64 (one per row, from :func:`row_seed`;
    unused when greedy), ``temperature`` (``<= 0``: greedy), ``top_p`` in (0, 1]. Returns int64 ``[B]`` on the
    logits' device; no host synchronisation.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [B, V], got shape {tuple(logits.shape)}")
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
    if seeds is None or seeds.shape != logits.shape[:1]:
        raise ValueError(f"seeds: expected one int64 seed per row ({logits.shape[0]}), got "
                         f"{None if seeds is None else tuple(seeds.shape)}")
    z = logits.float() / temperature
    if top_p < 1.0:
        z = z.masked_fill(~nucleus(torch.softmax(z, dim=-1), top_p), float("-inf"))
    g = -torch.log(-torch.log(uniforms(seeds, z.shape[1])))
    return torch.argmax(z + g, dim=-1)


def nucleus(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-``top_p`` nucleus of each row of probabilities ``p [B, V]`` fp32, as a bool mask: in descending order
    (ties by index), the tokens whose preceding mass is below ``top_p``.

    The order comes from one sort of the whole batch as 1-D int64 keys (row, then the probability's bits, which order
    non-negative floats), in place of PyTorch's segmented sort of the rows as ``[B, V]``: with that sort the whole
    sampler took 0.54 ms for 8 rows of 129,280 on an H100, against 0.16 ms without a nucleus (BENCHMARKS.md,
    sixtieth session). The 1-D form is not timed yet."""
    B, V = p.shape
    rows = torch.arange(B, dtype=torch.int64, device=p.device)[:, None]
    key = (rows << 32) | (0x7FFFFFFF - p.contiguous().view(torch.int32).to(torch.int64))
    order = torch.sort(key.reshape(-1), stable=True).indices
    sp = p.reshape(-1)[order].view(B, V)
    keep = (torch.cumsum(sp, dim=-1) - sp) < top_p
    keep[:, 0] = True  # (the most likely token, whatever the rounding of the sums)
    return torch.zeros(B * V, dtype=torch.bool, device=p.device).scatter_(0, order, keep.reshape(-1)).view(B, V)


def nucleus_ref(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """:func:`nucleus`'s rule written out row by row (its meaning, for tests and benchmarks): a stable descending
    sort of each row, the tokens whose preceding mass is below ``top_p``, the first always."""
    sp, si = torch.sort(p, dim=-1, descending=True, stable=True)
    keep = (torch.cumsum(sp, dim=-1) - sp) < top_p
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(1, si, keep)


__all__ = ["sample_tokens", "row_seed", "uniforms", "nucleus", "nucleus_ref"]
