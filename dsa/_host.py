"""Integer helpers for the launch code that runs on the host before every kernel.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s in Triton 3.6 and cost about 6 µs
per call from Python (these: under 0.1 µs); an op's launch path calls them several times per call.
Same results as Triton's for the non-negative integers they are used with.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


_FITTED: dict = {}


def launch_fitting(key, candidates, launch):
    """Call ``launch(cfg)`` with the first of ``candidates`` (launch configurations, best first) whose kernel the
    device can hold, and return its result. Triton raises ``OutOfResources`` before launching a kernel that needs
    more shared memory (or threads) than the device has, so a candidate that does not fit launches nothing; the
    next one is tried. The index that fitted is remembered per ``key`` (the device and whatever selects the
    variant), so later calls (and CUDA-graph captures) go straight to it. The configurations tuned on the H200
    (227 KiB of shared memory per block) are the first candidates; GPUs with less (e.g. 99 KiB on sm_86/89/120,
    64 KiB on MI300) take the smaller ones."""
    from triton.runtime.errors import OutOfResources

    i = _FITTED.get(key, 0)
    while True:
        try:
            out = launch(candidates[i])
        except OutOfResources:
            if i + 1 >= len(candidates):
                raise
            i += 1
            continue
        _FITTED[key] = i
        return out
