"""Independent fp8 formulations and cache-test helpers shared by the cache tests.

fp8 e4m3fn is decoded from its bit fields and rounded to nearest even by table search in
float64, so these helpers share no code with dsa's quantisers.
"""
from __future__ import annotations

import contextlib

import torch

from dsa.constants import FP8_AMAX_EPS, FP8_MAX
from utils import random_block_table

# ----------------------------------------------------------------------------------------------
# independent formulation (float64, fp8 e4m3fn from its bit fields)
# ----------------------------------------------------------------------------------------------
def e4m3_values() -> torch.Tensor:
    """float64 value of each of the 256 e4m3fn codes (NaN for 0x7F / 0xFF), from the bit fields."""
    vals = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            vals.append(float("nan"))
        elif e == 0:
            vals.append(sign * (m / 8.0) * 2.0**-6)
        else:
            vals.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


_POS = e4m3_values()[:0x7F]  # codes 0x00..0x7E: the non-negative finite values, ascending


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) of float64 ``y`` rounded to nearest e4m3fn, ties to even, saturating at 448."""
    a = y.abs().clamp(max=FP8_MAX).flatten()
    hi = torch.searchsorted(_POS, a).clamp(max=len(_POS) - 1)  # first value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - _POS[lo], _POS[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    code = torch.where(a == _POS[hi], hi, code)
    sign = torch.signbit(y.flatten()).to(torch.int64) << 7
    return (code | sign).to(torch.uint8).reshape(y.shape)


def pow2_ceil_f64(s: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(s)) exactly, through frexp (s = m * 2**e with m in [0.5, 1))."""
    m, e = torch.frexp(s.to(torch.float64))
    return torch.where(m == 0.5, s.to(torch.float64), torch.ldexp(torch.ones_like(m), e))


def independent_quant(x: torch.Tensor, group: int, ue8m0: bool):
    """(codes uint8 [..., n*group], scales float32 [..., n]) computed in float64.

    scale = fp32(max(amax, fp32(1e-4)) / 448) (f64 then f32: correctly rounded), pow2 when ue8m0;
    q = nearest-even e4m3 of fp32(x / scale) (f64 quotient then f32: correctly rounded, since
    53 >= 2*24 + 2).
    """
    *lead, w = x.shape
    g = x.to(torch.float64).reshape(*lead, w // group, group)
    eps = float(torch.tensor(FP8_AMAX_EPS, dtype=torch.float32))
    scale = (g.abs().amax(-1).clamp(min=eps) / FP8_MAX).to(torch.float32)
    if ue8m0:
        scale = pow2_ceil_f64(scale).to(torch.float32)
    y = (g / scale.to(torch.float64).unsqueeze(-1)).to(torch.float32).to(torch.float64)
    return e4m3_round(y).reshape(*lead, w), scale


def independent_dequant(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """bf16 of fp32(e4m3(code) * scale): the f64 product is exact (4 x 24 bits), then f32, then bf16."""
    v = e4m3_values()[codes.long()] * scales.to(torch.float64).repeat_interleave(group, dim=-1)
    return v.to(torch.float32).to(torch.bfloat16)


def across_magnitudes(rows: int, width: int, group: int, g: torch.Generator) -> torch.Tensor:
    """bf16 ``[rows, width]``: every group of ``group`` values gets its own magnitude, from 1e-9 (far
    below the 1e-4 amax clamp) to 1e30, plus groups right at the clamp and at power-of-two scale
    boundaries (amax = 448 * 2**k exactly and one bf16 ulp above)."""
    x = torch.randn(rows, width // group, group, generator=g, dtype=torch.float64)
    mag = 10.0 ** (torch.rand(rows, width // group, 1, generator=g, dtype=torch.float64) * 13 - 9)
    x = x * mag
    flat = x.view(-1, group)
    n = flat.shape[0]
    specials = [
        lambda v: v / v.abs().max() * 1e-4,  # amax == 1e-4 (the clamp)
        lambda v: v / v.abs().max() * 1.01e-4,  # just above the clamp
        lambda v: v / v.abs().max() * 9e-5,  # just below
        lambda v: v / v.abs().max() * 448.0,  # scale exactly 1
        lambda v: v / v.abs().max() * (448.0 * 2.0**-10),  # scale exactly 2**-10
        lambda v: v / v.abs().max() * (448.0 * 2.0**3 * (1 + 2.0**-7)),  # one bf16 ulp above 2**3
        lambda v: v / v.abs().max() * 3e35,  # very large values
        lambda v: v * 0.0 + 7.5,  # constant group
    ]
    for i, f in enumerate(specials):
        if 3 * i < n:
            flat[3 * i] = f(flat[3 * i])
    return x.reshape(rows, width).to(torch.bfloat16)


def paged_slot_mapping(q_lens, ctx_lens, block_size, g, *, pad=0, oob=0):
    """vLLM-style slots of new tokens: request r writes positions [ctx_r, ctx_r + q_r) through a
    shuffled block table. Then ``pad`` random entries are set to -1 and ``oob`` to slots past the
    cache. Returns (slot_mapping int64 [sum q], num_slots)."""
    total = [c + q for c, q in zip(ctx_lens, q_lens)]
    bt, num_blocks = random_block_table(total, block_size, g)
    slots = []
    for r, (c, q) in enumerate(zip(ctx_lens, q_lens)):
        pos = torch.arange(c, c + q)
        slots.append(bt[r, pos // block_size].long() * block_size + pos % block_size)
    sm = torch.cat(slots)
    num_slots = num_blocks * block_size
    idx = torch.randperm(sm.numel(), generator=g)
    sm[idx[:pad]] = -1
    sm[idx[pad:pad + oob]] = num_slots + torch.randint(0, 1000, (oob,), generator=g)
    return sm, num_slots


def random_bytes(shape, g) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@contextlib.contextmanager
def launch_config(table: dict, key: str, cfg: dict):
    """Temporarily use launch configuration ``cfg`` for ``table[key]`` (a kernel module's CONFIG)."""
    old = table[key]
    table[key] = cfg
    try:
        yield
    finally:
        table[key] = old
