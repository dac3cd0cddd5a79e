"""Input validation shared by the public wrappers.

Each check raises ``TypeError`` (not a tensor / wrong dtype) or ``ValueError``
(shape, device, stride, unsupported size) naming the argument, the expected
value and the actual one, before any kernel launch.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .constants import SUPPORTED_BLOCK_SIZES


def _fmt_dtypes(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    last_dim_contiguous: bool = True,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; ``None`` entries of ``shape`` match anything."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ndims:
            raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(e is None or e == a for e, a in zip(shape, t.shape))
        if not ok:
            want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected the last dim to be contiguous (stride 1), got strides {t.stride()}")
    return t


def check_same_device(**tensors) -> torch.device:
    """All given tensors (None skipped) must live on one device; returns it."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    dev = items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{k}: expected device {dev} (that of {items[0][0]}), got {v.device}")
    return dev


def check_block_size(name: str, block_size: int) -> int:
    if not isinstance(block_size, int) or block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{name}: expected a power of two from 1 to 256, got {block_size!r}")
    return block_size


def check_dim(name: str, actual: int, expected: int | Iterable[int], what: str = "size") -> None:
    exp = (expected,) if isinstance(expected, int) else tuple(expected)
    if actual not in exp:
        raise ValueError(f"{name}: expected {what} {' or '.join(map(str, exp))}, got {actual}")


def check_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v
