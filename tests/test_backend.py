import pytest
import torch

from dsa import backend


def test_resolve_values(monkeypatch):
    cpu = torch.device("cpu")
    assert backend.resolve("reference", cpu) == "reference"
    want = "triton" if backend.interpreter_on() else "reference"
    assert backend.resolve("auto", cpu) == want
    assert backend.resolve(None, cpu) == want
    monkeypatch.setenv("DSA_BACKEND", "reference")
    assert backend.resolve(None, cpu) == "reference"
    assert backend.resolve("auto", cpu) == want  # the argument wins over the environment


def test_bad_backend_names(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        backend.resolve("cuda", torch.device("cpu"))
    monkeypatch.setenv("DSA_BACKEND", "fast")
    with pytest.raises(ValueError, match="DSA_BACKEND"):
        backend.resolve(None, torch.device("cpu"))


def test_triton_unavailable_is_clear(monkeypatch):
    monkeypatch.setattr(backend, "interpreter_on", lambda: False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        backend.resolve("triton", torch.device("cpu"))
    assert backend.resolve("auto", torch.device("cpu")) == "reference"


def test_on_hopper_never_on_rocm_cpu_or_interpreter(monkeypatch):
    """The Gluon kernels' gate: a ROCm GPU (PyTorch calls it "cuda"; an MI300 reports capability 9.4) is not
    Hopper, nor is the CPU or a run under the interpreter; an NVIDIA device of capability 9.x is."""
    import dsa.backend as B

    monkeypatch.setattr(B, "_capability_major", lambda i: 9)
    monkeypatch.setattr(B, "interpreter_on", lambda: False)
    monkeypatch.setattr(B, "gluon_enabled", lambda: True)  # (the Triton release: test_gluon_kernels_only_with_their_triton)
    monkeypatch.setattr(torch.version, "hip", None)
    assert B.on_hopper(torch.device("cuda", 0))
    assert not B.on_hopper(torch.device("cpu"))
    monkeypatch.setattr(B, "_capability_major", lambda i: 8)
    assert not B.on_hopper(torch.device("cuda", 0))
    monkeypatch.setattr(B, "_capability_major", lambda i: 9)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not B.on_hopper(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(B, "interpreter_on", lambda: True)
    assert not B.on_hopper(torch.device("cuda", 0))


def test_gpu_target(monkeypatch):
    """What the launch code asks to pick a target's configurations (:data:`dsa.mla.kernel.TARGET_CONFIGS`):
    ``("cuda", capability)`` on NVIDIA, ``("hip", gfx arch)`` on ROCm (its feature suffix dropped), None on the CPU
    or under the interpreter."""
    import types

    import dsa.backend as B

    monkeypatch.setattr(B, "interpreter_on", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-"))
    monkeypatch.setattr(torch.version, "hip", None)
    B._gpu_target.cache_clear()
    assert B.gpu_target(torch.device("cuda", 0)) == ("cuda", 86)
    assert B.gpu_target(torch.device("cpu")) is None
    monkeypatch.setattr(torch.version, "hip", "6.2")
    B._gpu_target.cache_clear()
    assert B.gpu_target(torch.device("cuda", 0)) == ("hip", "gfx942")
    monkeypatch.setattr(B, "interpreter_on", lambda: True)
    assert B.gpu_target(torch.device("cuda", 0)) is None
    B._gpu_target.cache_clear()


def test_host_integer_helpers_match_triton():
    """The launch code's ``cdiv`` / ``next_power_of_2`` (plain Python, dsa._host) give Triton's results."""
    import triton

    from dsa._host import cdiv, next_power_of_2

    for a in range(0, 300):
        assert next_power_of_2(a) == triton.next_power_of_2(a)
        for b in (1, 2, 3, 16, 64, 127):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for a in (2 ** 31 - 1, 2 ** 31, 2 ** 40 + 3):
        assert next_power_of_2(a) == triton.next_power_of_2(a) and cdiv(a, 64) == triton.cdiv(a, 64)


def test_num_sms_cached_and_none_off_cuda(monkeypatch):
    """``backend.num_sms``: None for a CPU device; for a CUDA device the count, asked of the driver once."""
    import dsa.backend as B

    assert B.num_sms(torch.device("cpu")) is None
    calls = []

    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: (calls.append(i), Props)[1])
    B._sm_count.cache_clear()
    try:
        assert B.num_sms(torch.device("cuda", 3)) == 132 and B.num_sms(torch.device("cuda", 3)) == 132
        assert calls == [3]
    finally:
        B._sm_count.cache_clear()


def test_gluon_kernels_only_with_their_triton(monkeypatch):
    """The Gluon (Hopper) kernels serve only with the Triton release they are validated with, unless DSA_GLUON says
    otherwise; with any other the portable kernels run."""
    import triton

    from dsa import backend

    monkeypatch.delenv(backend.GLUON_ENV, raising=False)
    backend.gluon_validated.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.9.0")
        assert not backend.gluon_validated() and not backend.gluon_enabled()
        monkeypatch.setenv(backend.GLUON_ENV, "1")
        assert backend.gluon_enabled()
        backend.gluon_validated.cache_clear()
        monkeypatch.setattr(triton, "__version__", backend.GLUON_TRITON + "1")
        monkeypatch.setenv(backend.GLUON_ENV, "0")
        assert backend.gluon_validated() and not backend.gluon_enabled()
        monkeypatch.delenv(backend.GLUON_ENV)
        assert backend.gluon_enabled()
        monkeypatch.setattr(backend, "interpreter_on", lambda: False)
        monkeypatch.setattr(backend, "_capability_major", lambda i: 9)
        monkeypatch.setattr(torch.version, "hip", None)
        assert backend.on_hopper(torch.device("cuda", 0))
        monkeypatch.setenv(backend.GLUON_ENV, "0")
        assert not backend.on_hopper(torch.device("cuda", 0))
    finally:
        backend.gluon_validated.cache_clear()
