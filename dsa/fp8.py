"""fp8 e4m3fn quantisation shared by every writer (MLA cache, indexer cache, indexer q):
the PyTorch form (references) and the Triton form (kernels), defined once; and the e4m3fn
conversions of the portable kernels, native or in software.

scale = max(amax, FP8_AMAX_EPS) / 448 with IEEE division, rounded up to a power of two
(exact bit arithmetic) for ue8m0 scales; q = fp8(clamp(x / scale, +-448)), round to nearest even.

Where Triton has no e4m3fn type (NVIDIA Ampere, :func:`dsa.backend.fp8_native` False) the kernels take
fp8 tensors as their bytes (uint8) and a constexpr ``MODE`` (:func:`dsa.backend.fp8_mode`) selects the software
forms below: :func:`tl_e4m3_to_f16` (exact: every e4m3fn value is an f16) and :func:`tl_e4m3_from_f32` (round to
nearest even, saturating to +-448, NaN to 0x7F: the bits of the GPU's ``cvt.rn.satfinite``). fp8
products then run in f16 with fp32 accumulation: the same exact products, summed in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import FP8_AMAX_EPS, FP8_MAX

_MANTISSA_MASK = (1 << 23) - 1  # fp32 mantissa bits


def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Round positive normal fp32 values up to a power of two, exactly (bit arithmetic)."""
    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    bits = (bits + _MANTISSA_MASK) & ~_MANTISSA_MASK
    return bits.view(torch.float32)


def quantize_fp8_groups(x: torch.Tensor, group: int, ue8m0: bool):
    """Quantise ``x [..., n*group]`` to fp8 e4m3fn with one fp32 scale per ``group`` values.

    Returns ``(q [..., n*group] float8_e4m3fn, scale [..., n] float32)`` with
    ``scale = max(amax, 1e-4) / 448`` (rounded up to a power of two when ``ue8m0``) and
    ``q = fp8(clamp(x / scale, +-448))`` (IEEE fp32 division, round to nearest even).
    """
    *lead, width = x.shape
    g = x.to(torch.float32).reshape(*lead, width // group, group)
    amax = g.abs().amax(dim=-1)
    # divide by a tensor, not a Python scalar: PyTorch's CUDA kernel turns `t / scalar` into
    # `t * (1 / scalar)`, which is not the IEEE quotient
    scale = amax.clamp_min(FP8_AMAX_EPS) / torch.full_like(amax, FP8_MAX)
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, width), scale


@triton.jit
def tl_pow2_ceil(s):
    """Round positive normal fp32 values up to a power of two (exact: mantissa carry)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFFF) & -8388608  # -8388608 == 0xFF800000: keep sign and exponent
    return bits.to(tl.float32, bitcast=True)


# four e4m3fn bytes (one 32-bit register) -> four f16 of 2^-8 times their values (two registers of f16x2): each byte
# moved to the top of its 16-bit lane (prmt), then (b << 8) - ((b << 8) >> 1 & 0x3F80) = sign << 15 | magnitude << 7
_E4M3X4_F16 = tl.constexpr("{ .reg .b32 t, m; "
                           "prmt.b32 t, $2, 0, 0x1404; shr.b32 m, t, 1; and.b32 m, m, 0x3F803F80; sub.u32 $0, t, m; "
                           "prmt.b32 t, $2, 0, 0x3424; shr.b32 m, t, 1; and.b32 m, m, 0x3F803F80; sub.u32 $1, t, m; }")


@triton.jit
def tl_e4m3_to_f16(b, PTX: tl.constexpr = False):
    """e4m3fn bytes (uint8) as f16, exactly; 0x7F / 0xFF (e4m3fn's NaN) as NaN. The sign and the 7 magnitude bits
    placed in f16's sign and under its exponent field read as 2^-8 times the value (normal and subnormal alike),
    so one multiply by 2^8 (exact) finishes; a NaN byte then reads +-480, past every e4m3fn value. ``PTX`` (NVIDIA
    only): the bits by inline PTX, four bytes per register (about a quarter of the instructions)."""
    if PTX:
        h = tl.inline_asm_elementwise(_E4M3X4_F16, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)
    else:
        u = b.to(tl.uint16)
        h = ((u & 0x80) << 8 | (u & 0x7F) << 7).to(tl.float16, bitcast=True)
    h = h * 256.0
    return tl.where(tl.abs(h) > 448.0, float("nan"), h)


@triton.jit
def tl_e4m3_from_f32(y):
    """fp32 as e4m3fn bytes (uint8): round to nearest even, saturating to +-448 (+-inf too), NaN as 0x7F."""
    a = tl.abs(y)
    ab = a.to(tl.uint32, bitcast=True)
    # normal results (|y| >= 2^-6): fp32's mantissa rounded to 3 bits (ties to even; a carry moves the exponent),
    # the exponent rebiased from 127 to 7
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20).to(tl.int32) - (120 << 3)
    # subnormal results: |y| * 2^9 rounded to an integer by the fp32 addition of 2^23 (ties to even); 8 is 2^-6
    sub = ((a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000)
    m = tl.minimum(tl.where(a < 0.015625, sub, normal), 126)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    return tl.where(y != y, 127, m | sign).to(tl.uint8)


@triton.jit
def tl_fp8_operand(x, MODE: tl.constexpr):
    """An fp8 product operand as loaded: ``x`` itself where e4m3fn is native (``MODE`` 0, :func:`dsa.backend.fp8_mode`),
    else its bytes as f16 (exact)."""
    if MODE == 0:
        return x
    else:
        return tl_e4m3_to_f16(x, MODE == 2)


@triton.jit
def tl_fp8_to_f32(x, MODE: tl.constexpr):
    """e4m3fn values (the fp8 type, or their bytes as uint8) as fp32 (``MODE``: :func:`dsa.backend.fp8_mode`)."""
    if MODE == 0:
        if x.dtype == tl.uint8:
            x = x.to(tl.float8e4nv, bitcast=True)
        return x.to(tl.float32)
    else:
        return tl_e4m3_to_f16(x, MODE == 2).to(tl.float32)


@triton.jit
def tl_quant_fp8_rows(x, UE8M0: tl.constexpr, FP8_MAX_: tl.constexpr, AMAX_EPS: tl.constexpr, MODE: tl.constexpr):
    """Quantise each row of ``x [R, G]`` fp32: returns (bytes [R, G] uint8, scale [R] fp32).

    scale = max(amax, eps) / 448 (IEEE division), rounded up to 2^k when UE8M0;
    q = fp8_e4m3fn(clamp(x / scale, +-448)), round to nearest even (IEEE division, or the exact
    product with 2^-k for a power-of-two scale: the same bits). ``MODE`` 0 (:func:`dsa.backend.fp8_mode`): Triton's
    e4m3fn cast, else :func:`tl_e4m3_from_f32` (the same bits).
    """
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(tl.maximum(amax, AMAX_EPS), FP8_MAX_)
    if UE8M0:
        scale = tl_pow2_ceil(scale)
        # x / 2^e == x * 2^-e exactly; 2^-e by exponent arithmetic (0x7F000000 = 254 << 23).
        # The scale lies in [2^-22, 2^120], so its inverse is a normal number.
        inv = (0x7F000000 - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
        y = x * inv[:, None]
    else:
        y = tl.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -FP8_MAX_), FP8_MAX_)
    if MODE == 0:
        q = tl.cast(y, tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        q = tl_e4m3_from_f32(y)
    return q, scale
