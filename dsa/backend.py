"""Which implementation runs: the Triton kernel or the PyTorch reference.

Every public op takes ``backend=None | "auto" | "triton" | "reference"``. When it
is ``None`` the environment variable ``DSA_BACKEND`` (same values) decides, and
``auto`` is the default:

* ``auto``: the Triton kernel when Triton can run on the inputs' device (a GPU,
  or any device while Triton's CPU interpreter is on, ``TRITON_INTERPRET=1``),
  else the reference. ``import dsa`` therefore works on any machine.
* ``triton``: always the kernel; a clear ``RuntimeError`` if it cannot run.
* ``reference``: always the plain PyTorch reference.

``TRITON_INTERPRET`` is read by Triton when the kernels are defined, i.e. when
``dsa`` is imported: set it before ``import dsa``.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "DSA_BACKEND"


@functools.lru_cache(maxsize=None)
def interpreter_on() -> bool:
    """True when Triton's CPU interpreter is active (``TRITON_INTERPRET=1``). Read once: Triton fixes the mode of
    every kernel when it is defined, i.e. at ``import dsa`` (and every op asks, on every call)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:  # pragma: no cover - older/newer triton
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except Exception:  # pragma: no cover
        return False


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can run on tensors living on ``device``."""
    if not triton_importable():
        return False
    if interpreter_on():
        return True
    return device.type == "cuda" and _cuda_available()  # ROCm shows up as "cuda" too


def compiled_nvidia(device: torch.device) -> bool:
    """Whether kernels for ``device`` are compiled for an NVIDIA GPU (not ROCm, not the CPU interpreter): where
    NVIDIA-only launch options (``maxnreg``) and inline PTX may be used."""
    return device.type == "cuda" and torch.version.hip is None and not interpreter_on()


def nvidia_options(device: torch.device, **options) -> dict:
    """``options`` (NVIDIA-only launch options such as ``maxnreg``; None values dropped) where
    :func:`compiled_nvidia`, else none: Triton's AMD backend rejects them."""
    if not compiled_nvidia(device):
        return {}
    return {k: v for k, v in options.items() if v is not None}


#: set to 1 to run the software e4m3fn conversions on every device (tests; see :func:`fp8_native`)
FP8_EMULATION_ENV = "DSA_FP8_EMULATION"


def fp8_emulation_forced() -> bool:
    """Whether ``DSA_FP8_EMULATION`` asks for the software e4m3fn path everywhere."""
    return os.environ.get(FP8_EMULATION_ENV, "0") not in ("", "0")


def fp8_native(device: torch.device) -> bool:
    """Whether Triton has the e4m3fn type on ``device``: the portable kernels then load, convert and multiply fp8
    natively. Triton types e4m3fn on NVIDIA GPUs of compute capability 8.9 and later and on AMD GPUs (and in the
    CPU interpreter), not on Ampere (8.0 / 8.6 / 8.7), where the kernels take fp8 caches and operands as bytes and
    convert them in software instead (:mod:`dsa.fp8`: exact e4m3fn -> f16, round-to-nearest-even saturating
    f32 -> e4m3fn; products in f16 with fp32 accumulation). ``DSA_FP8_EMULATION=1`` takes the software path
    everywhere."""
    if fp8_emulation_forced():
        return False
    if interpreter_on() or device.type != "cuda" or torch.version.hip is not None:
        return True
    return _nvidia_fp8(device.index if device.index is not None else torch.cuda.current_device())


#: :func:`fp8_mode`'s values, the kernels' ``FP8_MODE`` constexpr
FP8_NATIVE, FP8_SOFTWARE, FP8_SOFTWARE_PTX = 0, 1, 2


def fp8_mode(device: torch.device) -> int:
    """How the portable kernels handle e4m3fn on ``device``: :data:`FP8_NATIVE` (Triton's type), else in software
    (:func:`fp8_native` False): :data:`FP8_SOFTWARE_PTX` where compiled for NVIDIA (the bytes unpacked four at a
    time by ``prmt`` in inline PTX), :data:`FP8_SOFTWARE` elsewhere (plain Triton operations: the CPU interpreter)."""
    if fp8_native(device):
        return FP8_NATIVE
    return FP8_SOFTWARE_PTX if compiled_nvidia(device) else FP8_SOFTWARE


@functools.lru_cache(maxsize=None)
def _nvidia_fp8(device_index: int) -> bool:
    major, minor = torch.cuda.get_device_capability(device_index)
    return _arch_has_e4m3(major * 10 + minor)


def _arch_has_e4m3(arch: int) -> bool:
    """Triton's own rule (its CUDA backend's ``supported_fp8_dtypes`` for this compute capability)."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.backends.compiler import GPUTarget

        opts = CUDABackend(GPUTarget("cuda", arch, 32)).parse_options({})
        return "fp8e4nv" in opts.supported_fp8_dtypes
    except Exception:  # pragma: no cover - another Triton layout
        return arch >= 89


#: the Triton release the Gluon (Hopper) kernels were written for and validated with (CI, the H200). Gluon is
#: Triton's experimental dialect: its API and code generation change between releases (3.5 lacks parts of it; with
#: 3.9 the kernels compile to other register and shared-memory budgets), so with any other release the portable
#: kernels serve Hopper GPUs too. ``DSA_GLUON=1`` takes the Gluon kernels anyway, ``DSA_GLUON=0`` never.
GLUON_TRITON = "3.6."
GLUON_ENV = "DSA_GLUON"
#: the environment variables that change which kernels an op launches (part of a launch plan's signature,
#: :func:`dsa._replay.planned`)
DISPATCH_ENV = (ENV_VAR, FP8_EMULATION_ENV, GLUON_ENV)


@functools.lru_cache(maxsize=None)
def gluon_validated() -> bool:
    """Whether the installed Triton is the release the Gluon kernels were validated with (:data:`GLUON_TRITON`)."""
    import triton

    return triton.__version__.startswith(GLUON_TRITON)


def gluon_enabled() -> bool:
    """Whether the Gluon kernels may be used at all: :func:`gluon_validated`, unless ``DSA_GLUON`` says otherwise."""
    env = os.environ.get(GLUON_ENV, "")
    if env not in ("", "auto"):
        return env not in ("0", "false", "False")
    return gluon_validated()


def on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA Hopper GPU (compute capability 9.x), the Triton interpreter is off and
    :func:`gluon_enabled`: where the Gluon kernels (``dsa.*.kernel_sm90``) may serve a call. ROCm GPUs, which
    PyTorch also calls "cuda" (an MI300 reports capability 9.4), are not."""
    if interpreter_on() or device.type != "cuda" or torch.version.hip is not None or not gluon_enabled():
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) == 9


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def gpu_target(device: torch.device) -> tuple | None:
    """What Triton compiles for on ``device``: ``("cuda", compute capability)`` (e.g. ``("cuda", 86)``) or
    ``("hip", gfx arch)`` (e.g. ``("hip", "gfx942")``); None under the Triton interpreter or off the GPU. The ops
    replace launch configurations tuned on the H200 by others where they spill registers on the target
    (:data:`dsa.mla.kernel.TARGET_CONFIGS`, :data:`dsa.mqa_logits.kernel.PREFILL_TARGET_CONFIGS`)."""
    if interpreter_on() or device.type != "cuda":
        return None
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_target(device_index: int) -> tuple:
    if torch.version.hip is not None:
        return ("hip", torch.cuda.get_device_properties(device_index).gcnArchName.split(":")[0])
    major, minor = torch.cuda.get_device_capability(device_index)
    return ("cuda", major * 10 + minor)


def num_sms(device: torch.device) -> int | None:
    """The streaming-multiprocessor count of a CUDA ``device`` (cached: launch code asks on every call);
    None for other devices (callers choose their CPU-interpreter grids)."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def resolve(backend: str | None, device: torch.device) -> str:
    """Return ``"triton"`` or ``"reference"`` for an op on ``device``."""
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    choice = choice.lower()
    if choice not in BACKENDS:
        src = "backend" if backend is not None else ENV_VAR
        raise ValueError(f"{src}: expected one of {BACKENDS}, got {choice!r}")
    if choice == "reference":
        return "reference"
    runs = triton_runs_on(device)
    if choice == "triton" and not runs:
        raise RuntimeError(
            f"backend='triton' requested but Triton cannot run on device {device}: "
            "use a GPU, or set TRITON_INTERPRET=1 before importing dsa to run the kernels on the CPU"
        )
    return "triton" if runs else "reference"


def describe() -> str:
    """One line saying what ``auto`` resolves to on this machine."""
    if interpreter_on():
        return "triton (CPU interpreter, TRITON_INTERPRET=1)"
    if torch.cuda.is_available() and triton_importable():
        return f"triton on {torch.cuda.get_device_name()}"
    return "reference (PyTorch; no GPU and TRITON_INTERPRET is not set)"
