"""Fixes to Triton's CPU interpreter (``TRITON_INTERPRET=1``), applied on import.

Triton 3.6's interpreter stores bf16 as uint16 and fp8 as uint8 numpy arrays and
gets three things wrong that `dsa`'s kernels rely on:

* ``tl.dot`` on bf16 operands multiplies the raw uint16 bit patterns as
  integers (garbage);
* fp32 -> bf16 casts truncate instead of rounding to nearest even;
* fp32 -> fp8 casts round half up, can carry into the exponent wrongly, and do
  not saturate like the GPU's ``cvt.rn.satfinite``;
* int <-> bf16/fp8 casts move the raw storage integers instead of converting;
* a runtime scalar used as an index (``for i in range(n)`` with ``n`` a kernel
  argument) fails with numpy >= 2 ("only 0-dimensional arrays can be converted"),
  because scalars are stored as 1-element arrays.

We replace those three builder methods with versions that reinterpret the bits
as the matching torch dtype and let torch do exact arithmetic and
round-to-nearest-even conversions, so a kernel gives the same bits under the
interpreter as on a GPU (up to fp32 summation order in dots).
"""
from __future__ import annotations

import numpy as np
import torch

_PATCHED = False
#: the Triton releases whose interpreter these fixes were checked with (the whole CPU suite: 3.6 in CI, 3.9 by hand);
#: 3.5's interpreter wraps its tensors with another signature and the fixes fail there
INTERPRETER_TRITON = ("3.6.", "3.9.")


def _torch_dtype(tt_dtype):
    import triton.language as tl

    table = {
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
        tl.float8e4b8: torch.float8_e4m3fnuz,
        tl.float8e5b16: torch.float8_e5m2fnuz,
    }
    return table.get(tt_dtype)


_STORAGE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_torch(data: np.ndarray, tt_dtype) -> torch.Tensor:
    """View interpreter storage (numpy) as a torch tensor of the real float dtype."""
    tdt = _torch_dtype(tt_dtype)
    arr = np.asarray(data, order="C")
    if tdt in (torch.float16, torch.float32, torch.float64):
        return torch.from_numpy(arr.copy())
    raw = torch.from_numpy(arr.view(np.uint8 if arr.dtype.itemsize == 1 else np.dtype(f"i{arr.dtype.itemsize}")).copy())
    return raw.view(tdt)


def _as_numpy(t: torch.Tensor, np_dtype) -> np.ndarray:
    if t.dtype in (torch.float16, torch.float32, torch.float64):
        return t.numpy().astype(np_dtype, copy=False)
    storage = _STORAGE[t.element_size()]
    return t.view(storage).numpy().view(np_dtype)


def _convert(src_data: np.ndarray, src_tt, dst_tt, np_dtype) -> np.ndarray:
    x = _as_torch(src_data, src_tt)
    if dst_tt.is_fp8():
        # the GPU converts with cvt.rn.satfinite: clamp to the finite range first
        finfo = torch.finfo(_torch_dtype(dst_tt))
        x = x.float().clamp(finfo.min, finfo.max)
    return _as_numpy(x.to(_torch_dtype(dst_tt)), np_dtype)


def _is_float(tt) -> bool:
    return _torch_dtype(tt) is not None


def patch_interpreter() -> bool:
    """Install the fixes into Triton's interpreter builder. Idempotent.

    Returns True when the builder is (now) patched.
    """
    global _PATCHED
    if _PATCHED:
        return True
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - triton missing or changed
        return False
    import triton

    if not triton.__version__.startswith(INTERPRETER_TRITON):
        import warnings

        warnings.warn(f"dsa's fixes to Triton's CPU interpreter were checked with Triton 3.6 and 3.9; with "
                      f"{triton.__version__} kernels under TRITON_INTERPRET=1 may fail or give wrong values "
                      f"(pip install triton==3.6.0 for CPU runs)", RuntimeWarning, stacklevel=2)
    import triton.language as tl

    _BITS_STORED = (tl.bfloat16, tl.float8e4nv, tl.float8e5, tl.float8e4b8, tl.float8e5b16)
    builder = interp.InterpreterBuilder
    orig_dot = builder.create_dot
    orig_cast = builder.cast_impl
    orig_fp_to_fp = builder.create_fp_to_fp
    get_np = interp._get_np_dtype

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        sa, sb = a.dtype.scalar, b.dtype.scalar
        if _is_float(sa) and _is_float(sb):
            af = _as_torch(a.data, sa).to(torch.float32).numpy()
            bf = _as_torch(b.data, sb).to(torch.float32).numpy()
            acc_dtype = d.data.dtype
            out = np.matmul(af.astype(acc_dtype), bf.astype(acc_dtype)) + d.data
            return interp.TensorHandle(out.astype(acc_dtype), d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if _is_float(s) and _is_float(t) and (s != t):
            return interp.TensorHandle(_convert(src.data, s, t, get_np(dst_type)), t)
        if s.is_int() and t in _BITS_STORED:  # int -> bf16 / fp8: Triton stores the raw integer
            x = torch.from_numpy(np.asarray(src.data).astype(np.float64))
            return interp.TensorHandle(_as_numpy(x.to(_torch_dtype(t)), get_np(dst_type)), t)
        if s in _BITS_STORED and t.is_int():  # bf16 / fp8 -> int: Triton casts the raw bits
            x = _as_torch(src.data, s).to(torch.float64).trunc().numpy()
            return interp.TensorHandle(x.astype(get_np(dst_type)), t)
        return orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        import triton._C.libtriton.ir as ir  # noqa: F401

        s, t = src.dtype.scalar, dst_type.scalar
        rtz = rounding_mode is not None and "RTZ" in str(rounding_mode)
        if _is_float(s) and _is_float(t) and not rtz:
            return interp.TensorHandle(_convert(src.data, s, t, get_np(dst_type)), t)
        return orig_fp_to_fp(self, src, dst_type, rounding_mode)

    orig_patch_tensor = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    for name in ("create_fp_ext", "create_fp_trunc"):
        setattr(builder, name, lambda self, src, dst_type: self.cast_impl(src, dst_type))
    builder.create_fp_to_fp = create_fp_to_fp
    builder._dsa_original = {"create_dot": orig_dot, "cast_impl": orig_cast, "create_fp_to_fp": orig_fp_to_fp}

    # Triton 3.9's interpreter keeps some comparisons of runtime scalars as int32, and a mask combined with one
    # (``tile_mask & scalar_ok``) reaches loads and stores as int32, which its native load/store reject ("mask has
    # unsupported dtype"). Compiled code treats any nonzero mask as true: so do these (a no-op on 3.6's bool masks).
    def _bool_mask(mask):
        if mask is not None and mask.data.dtype != np.bool_:
            return interp.TensorHandle(mask.data != 0, tl.int1)
        return mask

    orig_load, orig_store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, *args):
        return orig_load(self, ptrs, _bool_mask(mask), *args)

    def create_masked_store(self, ptrs, value, mask, *args):
        return orig_store(self, ptrs, value, _bool_mask(mask), *args)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    builder._dsa_original.update(create_masked_load=orig_load, create_masked_store=orig_store)
    _PATCHED = True
    return True
