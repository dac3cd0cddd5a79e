"""The software e4m3fn conversions (dsa.fp8) against torch's, and the rules that pick them (dsa.backend).

Every fp8 op's own tests also run on the software path (``tests/conftest.py``: the ``emulated`` variants)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsa import backend
from dsa.fp8 import tl_e4m3_from_f32, tl_e4m3_to_f16

from utils import DEVICE, gen


@triton.jit
def _decode_kernel(b_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl_e4m3_to_f16(tl.load(b_ptr + i)))


@triton.jit
def _encode_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, tl_e4m3_from_f32(tl.load(x_ptr + i, mask=i < n, other=0.0)), mask=i < n)


def test_decode_every_byte():
    b = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.full((256,), 7.0, dtype=torch.float16, device=DEVICE)
    _decode_kernel[(1,)](b, out, N=256)
    ref = b.view(torch.float8_e4m3fn).to(torch.float16)
    nan = ref.isnan()
    assert int(nan.sum()) == 2  # 0x7F and 0xFF
    assert torch.equal(out[~nan], ref[~nan]) and bool(out[nan].isnan().all())
    # signed zeros and the subnormals keep their bits
    assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@triton.jit
def _decode_ptx_kernel(b_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl_e4m3_to_f16(tl.load(b_ptr + i), True))


@pytest.mark.gpu
def test_gpu_decode_ptx_every_byte():
    """The inline-PTX form (NVIDIA; four bytes per register) gives the same bits as torch for all 256 bytes, in
    every position of the register (the bytes rotated through the four lanes)."""
    if not backend.compiled_nvidia(torch.device("cuda")):
        pytest.skip("inline PTX: NVIDIA only")
    for shift in range(4):
        b = torch.roll(torch.arange(256, dtype=torch.uint8, device="cuda"), shift)
        out = torch.full((256,), 7.0, dtype=torch.float16, device="cuda")
        _decode_ptx_kernel[(1,)](b, out, N=256)
        ref = b.view(torch.float8_e4m3fn).to(torch.float16)
        nan = ref.isnan()
        assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan]) and bool(out[nan].isnan().all())


def _encode(x: torch.Tensor) -> torch.Tensor:
    out = torch.full(x.shape, 0xA5, dtype=torch.uint8, device=x.device)
    _encode_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def test_encode_rounds_to_nearest_even_and_saturates():
    g = gen(0)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[~codes.isnan()].unique().sort().values
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties between neighbours
    up = torch.nextafter(mids, torch.full_like(mids, 1e9))
    down = torch.nextafter(mids, torch.full_like(mids, -1e9))
    rand = [torch.randn(1 << 15, generator=g) * s for s in (1e-4, 3e-3, 0.02, 0.3, 1.0, 10.0, 100.0, 300.0)]
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 463.9, 464.0, 464.1, 479.0, 480.0, 1e6, -1e6, 2.0 ** -6,
                            2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 1e-40, -1e-40, float("inf"), float("-inf")])
    x = torch.cat([vals, mids, up, down, -mids, -up, -down, special, *rand]).float().to(DEVICE)
    out = _encode(x)
    # the GPU's cvt.rn.satfinite: round to nearest even, +-inf and overflow to +-448
    ref = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = out != ref
    assert not bool(bad.any()), (x[bad][:8].tolist(), out[bad][:8].tolist(), ref[bad][:8].tolist())
    assert _encode(torch.tensor([float("nan")], device=DEVICE)).item() == 0x7F


def test_fp8_native_rule(monkeypatch):
    # Triton's own rule for NVIDIA: e4m3fn from compute capability 8.9 on
    assert [backend._arch_has_e4m3(a) for a in (80, 86, 87, 89, 90, 100, 120)] == [False] * 3 + [True] * 4
    cpu = torch.device("cpu")
    assert backend.fp8_native(cpu)  # the CPU interpreter (and any non-CUDA device) types e4m3fn
    monkeypatch.setenv(backend.FP8_EMULATION_ENV, "1")
    assert not backend.fp8_native(cpu)
    monkeypatch.setenv(backend.FP8_EMULATION_ENV, "0")
    assert backend.fp8_native(cpu)


def test_nvidia_only_options(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(backend, "interpreter_on", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert backend.nvidia_options(cuda, maxnreg=128) == {"maxnreg": 128}
    assert backend.nvidia_options(cuda, maxnreg=None) == {}
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: Triton's AMD backend rejects maxnreg
    assert backend.nvidia_options(cuda, maxnreg=128) == {}
    assert not backend.compiled_nvidia(cuda)
    assert backend.fp8_native(cuda)  # Triton types e4m3fn on AMD GPUs
    assert backend.fp8_mode(cuda) == backend.FP8_NATIVE
    monkeypatch.setenv(backend.FP8_EMULATION_ENV, "1")
    assert backend.fp8_mode(cuda) == backend.FP8_SOFTWARE  # no inline PTX on ROCm
    monkeypatch.setattr(torch.version, "hip", None)
    assert backend.fp8_mode(cuda) == backend.FP8_SOFTWARE_PTX
    assert backend.fp8_mode(torch.device("cpu")) == backend.FP8_SOFTWARE


@pytest.mark.parametrize("n_fit", [0, 1, 3])
def test_launch_fitting_takes_the_first_that_fits(n_fit):
    from triton.runtime.errors import OutOfResources

    from dsa._host import launch_fitting

    tried = []

    def launch(cfg):
        tried.append(cfg)
        if cfg < n_fit:
            raise OutOfResources(300000, 232448, "shared memory")
        return cfg * 10

    key = ("test", n_fit, object())  # a key of its own
    assert launch_fitting(key, [0, 1, 2, 3], launch) == n_fit * 10
    assert tried == list(range(n_fit + 1))
    tried.clear()
    assert launch_fitting(key, [0, 1, 2, 3], launch) == n_fit * 10 and tried == [n_fit]  # remembered


def test_launch_fitting_raises_when_nothing_fits():
    from triton.runtime.errors import OutOfResources

    from dsa._host import launch_fitting

    def launch(cfg):
        raise OutOfResources(300000, 65536, "shared memory")

    with pytest.raises(OutOfResources):
        launch_fitting(("test", "never"), [0, 1], launch)
