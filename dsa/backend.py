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


def on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA Hopper GPU (compute capability 9.x) and the Triton interpreter is
    off: where the Gluon kernels (``dsa.*.kernel_sm90``) may serve a call. ROCm GPUs, which PyTorch also
    calls "cuda" (an MI300 reports capability 9.4), are not."""
    if interpreter_on() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) == 9


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


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
