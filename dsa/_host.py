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
