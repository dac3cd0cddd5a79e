"""dsa fixes Triton's CPU interpreter on import: bf16 tl.dot, fp32->bf16 and fp32->fp8 casts.

Each test runs a real interpreted kernel; the `unpatched` variants restore Triton's
original builder methods for one launch and show the same check fails without the fix.
"""
import contextlib

import pytest
import torch
import triton
import triton.language as tl

from dsa.backend import interpreter_on

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="only meaningful under TRITON_INTERPRET=1")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(x_ptr, bf_ptr, f8_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    x = tl.load(x_ptr + r)
    tl.store(bf_ptr + r, x.to(tl.bfloat16))
    tl.store(f8_ptr + r, x.to(tl.float8e4nv))


@contextlib.contextmanager
def _unpatched():
    from triton.runtime.interpreter import InterpreterBuilder as B

    saved = {k: getattr(B, k) for k in ("create_dot", "cast_impl", "create_fp_to_fp", "create_fp_ext", "create_fp_trunc")}
    orig = B._dsa_original
    B.create_dot, B.cast_impl, B.create_fp_to_fp = orig["create_dot"], orig["cast_impl"], orig["create_fp_to_fp"]
    B.create_fp_ext = B.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(B, k, v)


def _dot(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 64, generator=g).to(dtype)
    b = torch.randn(64, 32, generator=g).to(dtype)
    c = torch.full((16, 32), float("nan"))
    _dot_kernel[(1,)](a, b, c, 16, 32, 64)
    return c, a.double() @ b.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32])
def test_dot_exact(dtype):
    c, ref = _dot(dtype, 0)
    # products of bf16/fp16/fp8 values are exact in fp32; only the fp32 summation rounds
    assert torch.allclose(c.double(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_dot_broken_without_fix():
    with _unpatched():
        c, ref = _dot(torch.bfloat16, 1)
    assert not torch.allclose(c.double(), ref, rtol=1e-2, atol=1e-2)


def _casts(seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes across the fp8 range, values past 448 (saturate), and exact ties for bf16 rounding
    x = torch.randn(2048, generator=g) * torch.logspace(-3, 3, 2048)
    x[:8] = torch.tensor([500.0, -1000.0, 448.0, -449.0, 1e-9, -0.0, 1 + 2**-8, 1 + 3 * 2**-8])
    bf = torch.empty(2048, dtype=torch.bfloat16)
    f8 = torch.empty(2048, dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](x, bf, f8, 2048)
    return x, bf, f8


def test_casts_round_to_nearest_even_and_saturate():
    x, bf, f8 = _casts(2)
    assert torch.equal(bf.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(f8.view(torch.uint8), want.view(torch.uint8))


def test_casts_wrong_without_fix():
    with _unpatched():
        x, bf, f8 = _casts(3)
    bf_ok = torch.equal(bf.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    f8_ok = torch.equal(f8.view(torch.uint8), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert not bf_ok and not f8_ok


@triton.jit
def _loop_kernel(x_ptr, n, N: tl.constexpr):
    acc = tl.zeros([N], tl.float32)
    for i in range(n):  # runtime trip count
        acc += i
    for _ in tl.range(1, n, 2):
        acc += 100
    tl.store(x_ptr + tl.arange(0, N), acc)


def test_runtime_trip_count_loop():
    x = torch.full((4,), float("nan"))
    _loop_kernel[(1,)](x, 5, 4)
    assert torch.equal(x, torch.full((4,), 10.0 + 200.0))


@triton.jit
def _int_cast_kernel(i_ptr, bf_ptr, back_ptr, N: tl.constexpr):
    r = tl.arange(0, N)
    i = tl.load(i_ptr + r)
    b = i.to(tl.bfloat16)
    tl.store(bf_ptr + r, b)
    tl.store(back_ptr + r, b.to(tl.int32))


def test_int_bf16_casts():
    i = torch.arange(-300, 724, 1, dtype=torch.int32) * 7
    bf = torch.empty(1024, dtype=torch.bfloat16)
    back = torch.full((1024,), -1, dtype=torch.int32)
    _int_cast_kernel[(1,)](i, bf, back, 1024)
    assert torch.equal(bf, i.to(torch.bfloat16))
    assert torch.equal(back, i.to(torch.bfloat16).to(torch.int32))
