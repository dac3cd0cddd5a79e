"""Launch plans: an op's eager GPU call replayed from a record of its first call with the same signature.

Every public op of the package is planned (:func:`planned`): ``sparse_mla``, the indexer's logits, top-k, the cache
writers and readers, the indexer's q / k preparation and the metadata ops.

An eager call of an op spends most of its host time deciding what to launch (checks, dispatch rules, launch
configurations) and in Triton's launch path, which binds and specialises every argument before the launcher runs.
Whatever an op decides is a function of its arguments' signature: shapes, strides, dtypes, devices, alignment,
which optional arguments are given and the Python scalars (and, where an op says so, how far a tensor's storage
runs past its end: ``slack``). So the first call with a signature is recorded: every tensor it allocates
(``torch.empty`` / ``torch.zeros`` and the like, in order) and every kernel it launches (the compiled kernel, its
grid and its arguments, each pointer as an offset into one of the call's tensors or one of its allocations, each
host tensor descriptor with its base pointer so located). A later call with the same signature replays that record:
the same allocations, and the same compiled kernels launched directly through Triton's launcher with the pointers
moved to this call's tensors; it returns the same tensors, or the same views of them. Nothing is decided twice, and
the result is bitwise the same as the call's own path.

A call is recorded only where replaying it is exact: a call that runs any other torch operation than an allocation,
a view or the zero fill of its own allocation (a copy, a reduction, a read back to the host), passes a pointer into
memory that is neither one of its tensors, one of its allocations nor a registered lasting buffer
(:func:`keep`), returns anything else than its own tensors, allocations or views of them, or launches with a callable
grid, is not: its signature runs the op's own path every time (:func:`why` says what stopped it; :func:`stats`
counts). A planned op called inside another's recording is part of that recording. Plans are off under Triton's CPU
interpreter, where there are no compiled kernels, while a launch hook is set (a profiler), and with ``DSA_PLANS=0``.

A plan holds what the dispatch rules decided. Code that changes them while it runs (tests and A/B scripts patching a
module's constants) calls :func:`clear` after each change, or turns plans off (:func:`set_enabled`).

Measured (BENCHMARKS.md, fifty-seventh and fifty-eighth sessions): host µs per eager ``sparse_mla`` decode call with
the GPU kept busy, plans off -> on, 181-239 -> 43-55 on the H200 machine, where the kernels take 9-35 µs; the eager
decode steps of ``dsa run`` (4 layers, every op planned, H100 machine) 475 -> 686 tokens/s.
"""
from __future__ import annotations

import functools
import inspect
import os
import threading

import torch

from . import backend as _backend

#: plans kept (per process); past this the cache starts over
MAX_PLANS = 4096
#: signatures an op records (:func:`planned`) before its new ones are recorded only while its plans are replayed at
#: least as often as it records: a recording costs more than a plain call, and an argument that changes at every call
#: (a growing length, say) would otherwise be recorded every time and never replayed
RECORD_FREELY = 64

_ALLOC = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
          torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default}
_ZEROS = {torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default}
_FILL_ZERO = torch.ops.aten.zero_.default

_PLANS: dict = {}
_RECORDED: dict = {}  # op -> signatures recorded
_REPLAYED: dict = {}  # op -> calls replayed
_KEPT: dict = {}  # data_ptr -> (tensor, bytes): buffers that live as long as the process
_LOCK = threading.Lock()
_LOCAL = threading.local()
_state = {"enabled": None}


def enabled() -> bool:
    """Whether calls are recorded and replayed: a Triton that compiles (not the interpreter), ``DSA_PLANS`` not
    ``0`` (read once), and no launch hook set."""
    on = _state["enabled"]
    if on is None:
        on = _state["enabled"] = os.environ.get("DSA_PLANS", "1") != "0" and not _backend.interpreter_on()
    if not on:
        return False
    knobs = _state.get("knobs")
    if knobs is None:
        from triton import knobs

        _state["knobs"] = knobs
    return not _hooked(knobs.runtime.launch_enter_hook) and not _hooked(knobs.runtime.launch_exit_hook)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set (Triton 3.6 holds a chain of hooks, empty unless a profiler added one)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def set_enabled(on: bool | None) -> None:
    """Turn plans on or off for this process (tests and benchmarks compare both ways; ``None``: as
    :func:`enabled` decides). The plans recorded stay."""
    _state["enabled"] = None if on is None else bool(on)


def clear() -> None:
    """Forget every plan (tests that change a module's dispatch constants call this, as the plans hold what those
    constants decided)."""
    _PLANS.clear()
    _RECORDED.clear()
    _REPLAYED.clear()


def keep(t: torch.Tensor) -> torch.Tensor:
    """Register ``t`` as a buffer that lives as long as the process (an op's cached zero row, say): a recorded
    launch may then take its address as it is. Returns ``t``."""
    _KEPT[t.data_ptr()] = (t, _span(t))
    return t


def tensor_key(t):
    """What a plan's signature holds of one tensor argument (``None`` stays ``None``): shape, strides, dtype,
    device and the address modulo 16 (the launcher specialises pointers on 16-byte alignment)."""
    return None if t is None else _arg_key(t, [])


def _device() -> int:
    """The current CUDA device (-1 without CUDA: the unit tests' CPU records)."""
    return torch._C._cuda_getDevice() if _backend._cuda_available() else -1


def lookup(key):
    """The plan recorded for ``key`` on the current device: a callable taking the call's tensors (as given to
    :func:`record`), or ``None`` when there is none yet, or when the signature does not replay."""
    plan = _PLANS.get((key, _device()))
    return None if plan is None or isinstance(plan, _NoPlan) else plan


def record(key, tensors: tuple, fn, op=None):
    """Run ``fn()`` (the op's own path) and record it as the plan for ``key``. ``tensors``: the call's tensor
    arguments (``None`` for those not given), in the order a replay receives them; ``op``: the op recording (see
    :data:`RECORD_FREELY`). Returns what ``fn`` returns. A signature recorded before (one that does not replay), or
    one the op does not record now, only runs ``fn()``."""
    device = _device()
    n = _RECORDED.get(op, 0)
    if (key, device) in _PLANS or (n >= RECORD_FREELY and _REPLAYED.get(op, 0) < n):
        return fn()
    _RECORDED[op] = n + 1
    rec = _Recorder(tensors, device)
    with _LOCK:
        _LOCAL.recorder = rec
        try:
            with _patched_run(), rec:
                result = fn()
        finally:
            _LOCAL.recorder = None
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    plan = rec.plan(result)
    _PLANS[(key, device)] = plan if plan is not None else _NoPlan(rec.unfit or "returns other tensors")
    return result


class _NoPlan(str):
    """Why a signature does not replay (what :func:`why` tells)."""


def why(key) -> str | None:
    """Why the signature ``key`` runs the op's own path every time (``None``: it replays, or was not recorded)."""
    plan = _PLANS.get((key, _device()))
    return str(plan) if isinstance(plan, _NoPlan) else None


def stats() -> dict:
    """Per planned op (by name): signatures ``recorded``, calls ``replayed``, and ``unfit``: how many of its recorded
    signatures run the op's own path every time, by reason (:func:`why`)."""
    out = {}
    for op in set(_RECORDED) | set(_REPLAYED):
        if op is not None:
            out[getattr(op, "__name__", str(op))] = {"recorded": _RECORDED.get(op, 0),
                                                      "replayed": _REPLAYED.get(op, 0), "unfit": {}}
    for (key, _), plan in _PLANS.items():
        if isinstance(plan, _NoPlan) and isinstance(key, tuple) and key and key[0] in _RECORDED:
            unfit = out[getattr(key[0], "__name__", str(key[0]))]["unfit"]
            unfit[str(plan)] = unfit.get(str(plan), 0) + 1
    return out


def planned(op=None, *, slack: tuple = ()):
    """Decorate a public op: its eager calls on a GPU are recorded per signature and replayed (see the module's
    docstring). The signature holds each tensor argument's :func:`tensor_key`, every other argument's type and value,
    and the environment variables that change what an op runs (:data:`dsa.backend.DISPATCH_ENV`). ``slack``: the
    names of tensor parameters whose storage past their last element the op looks at (up to 16 bytes: whether
    16-byte loads may run past a row's end); that many bytes join the signature. A call whose arguments do not hash,
    whose first tensor is not on a CUDA device, that ``torch.compile`` traces, that runs inside another op's
    recording or that asks for the PyTorch reference (``backend="reference"`` or ``DSA_BACKEND=reference``) runs
    the op as it is; so does a new signature where :data:`RECORD_FREELY` says not to record it.
    ``@planned`` or ``@planned(slack=(...))``."""
    if op is None:
        return functools.partial(planned, slack=slack)
    params = list(inspect.signature(op).parameters)
    slack_at = tuple((params.index(n), n) for n in slack)

    @functools.wraps(op)
    def call(*args, **kwargs):
        if (not enabled() or torch.compiler.is_compiling()  # (traced by torch.compile: the op as it is)
                or getattr(_LOCAL, "recorder", None) is not None):  # (inside another op's recording: part of it)
            return op(*args, **kwargs)
        tensors = []
        env = _dispatch_env()
        backend = kwargs.get("backend")
        if _reference(backend if backend is not None else env[_BACKEND_AT]):  # (PyTorch ops: nothing to replay)
            return op(*args, **kwargs)
        try:
            key = (op, tuple([_arg_key(a, tensors) for a in args]),
                   tuple([(k, _arg_key(kwargs[k], tensors)) for k in sorted(kwargs)]) if kwargs else (), env)
            if slack_at:
                key += tuple(_slack(args[i] if i < len(args) else kwargs.get(n)) for i, n in slack_at)
            if not tensors or not _on_gpu(tensors[0]):
                return op(*args, **kwargs)
            plan = lookup(key)
        except TypeError:  # (an argument that does not hash: the op's checks say what is wrong with it)
            return op(*args, **kwargs)
        if plan is not None:
            _REPLAYED[op] = _REPLAYED.get(op, 0) + 1
            return plan(tensors)
        return record(key, tuple(tensors), lambda: op(*args, **kwargs), op)

    call.unplanned = op
    return call


def _slack(t) -> int | None:
    """Bytes of ``t``'s storage past its last element, up to 16 (``None`` for a non-tensor)."""
    if not isinstance(t, torch.Tensor):
        return None
    return min(16, t.untyped_storage().nbytes() - t.storage_offset() * t.element_size() - _span(t))


def _on_gpu(t: torch.Tensor) -> bool:
    """Whether a call with first tensor ``t`` is planned (its tensors on a CUDA device)."""
    return t.is_cuda


_SCALARS = frozenset({bool, int, float, str, type(None)})


def _arg_key(a, tensors: list):
    """One argument's part of a signature (a tensor's: :func:`tensor_key`); its tensors appended to ``tensors``, in
    order."""
    if isinstance(a, torch.Tensor):
        tensors.append(a)
        return a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16
    if type(a) in _SCALARS:
        return type(a), a
    if isinstance(a, (tuple, list)):
        return type(a), tuple([_arg_key(x, tensors) for x in a])
    hash(a)
    return type(a), a


def _env_reader():
    """A function returning the values of :data:`dsa.backend.DISPATCH_ENV` now: from ``os.environ``'s own mapping
    (which its assignments update) where CPython has one, 10 times faster than ``os.environ.get``; else through
    ``os.environ.get``."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        keys = tuple(encode(v) for v in _backend.DISPATCH_ENV)
        return lambda: tuple(map(data.get, keys))
    return lambda: tuple(os.environ.get(v) for v in _backend.DISPATCH_ENV)


_dispatch_env = _env_reader()
_BACKEND_AT = _backend.DISPATCH_ENV.index(_backend.ENV_VAR)


def _reference(backend) -> bool:
    """Whether a call's ``backend`` (argument, else ``DSA_BACKEND``; str or the environment's bytes) is the
    PyTorch reference."""
    if backend is None:
        return False
    if isinstance(backend, bytes):
        backend = backend.decode(errors="replace")
    return isinstance(backend, str) and backend.lower() == "reference"


def _span(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to one past its last element."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


class _Unfit(Exception):
    """The recorded call cannot be replayed exactly."""


class _patched_run:
    """Triton's ``JITFunction.run`` wrapped, while a call is recorded, so that the recording thread's launches are
    seen with the compiled kernel each one ran."""

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self.cls, self.orig = JITFunction, JITFunction.run
        orig = self.orig

        def run(jit, *args, grid, warmup, **kwargs):
            kernel = orig(jit, *args, grid=grid, warmup=warmup, **kwargs)
            rec = getattr(_LOCAL, "recorder", None)
            if rec is not None and not warmup:
                rec.launch(jit, grid, args, kwargs, kernel)
            return kernel

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        self.cls.run = self.orig
        return False


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Sees every torch operation of the recorded call (allocations, views, anything else) and, through
    :class:`_patched_run`, its launches."""

    def __init__(self, tensors, device: int):
        super().__init__()
        self.tensors, self.device = tensors, device
        self.allocs = []  # the tensors the call allocated, in order
        self.events = []  # ("alloc", i, zeroed) / ("zero", i) / ("launch", launcher, function, metadata, grid,
        #                                                         template, pointers)
        self.unfit = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.unfit is not None:
            return out
        if func in _ALLOC or func in _ZEROS:
            if not out.is_contiguous():
                self.unfit = "a strided allocation"
            self.events.append(("alloc", len(self.allocs), func in _ZEROS))
            self.allocs.append(out)
        elif not func.is_view:
            own = None if func is not _FILL_ZERO else next(
                (i for i, a in enumerate(self.allocs) if _same(args[0], a)), None)
            if own is None:
                self.unfit = f"runs {func}"
            else:
                self.events.append(("zero", own))
        return out

    def _source(self, ptr: int):
        """``(source, offset)`` of a pointer: source ``i`` < the call's tensor count is its tensor ``i``, then its
        allocations in order; ``None`` with the pointer itself for a kept buffer."""
        found = []
        for i, t in enumerate(list(self.tensors) + self.allocs):
            if t is None or t.data_ptr() in _KEPT:  # (a kept buffer this call allocated: found below)
                continue
            base = t.data_ptr()
            if base <= ptr < base + _span(t):
                found.append((i, ptr - base))
        for base, (_, size) in _KEPT.items():
            if base <= ptr < base + size:
                found.append((None, ptr))
        if len(found) != 1:
            raise _Unfit(f"a pointer into {len(found)} of the call's tensors, allocations and kept buffers")
        return found[0]

    def launch(self, jit, grid, args, kwargs, kernel):
        if self.unfit is not None:
            return
        try:
            if callable(grid):
                raise _Unfit("a callable grid")
            if kernel is None:
                raise _Unfit("no compiled kernel")
            names = [p.name for p in jit.params]
            bound = dict(zip(names, args))
            bound.update((k, v) for k, v in kwargs.items() if k in names)
            for p in jit.params:
                if p.name not in bound:
                    if p.default is inspect.Parameter.empty:
                        raise _Unfit(f"argument {p.name} missing")
                    bound[p.name] = p.default
            template, ptrs, descs = [], [], []
            for pos, (name, p) in enumerate(zip(names, jit.params)):
                v = bound[name]
                if getattr(p, "is_constexpr", False):  # (compiled in; the launcher skips it)
                    template.append(v)
                elif isinstance(v, torch.Tensor):
                    src, off = self._source(v.data_ptr())
                    template.append(off if src is None else 0)
                    if src is not None:
                        ptrs.append((pos, src, off))
                elif _is_descriptor(v):  # (a host tensor descriptor: made again on the replay's base pointer)
                    src, off = self._source(v.base.data_ptr())
                    template.append(None)
                    descs.append((pos, src, off, (tuple(v.shape), tuple(v.strides), tuple(v.block_shape),
                                                  getattr(v, "layout", None), v.padding)))
                elif not _plain(v):  # (tuples, layouts as runtime arguments)
                    raise _Unfit(f"argument {name} of type {type(v).__name__}")
                else:
                    template.append(v)
            g = tuple(grid) + (1,) * (3 - len(grid))
            kernel._init_handles()
            self.events.append(("launch", kernel.run, kernel.function, kernel.packed_metadata, g, tuple(template),
                                tuple(ptrs), tuple(descs)))
        except _Unfit as e:
            self.unfit = str(e)

    def _view_of(self, r: torch.Tensor, kept: set):
        """``("view", source, dtype, shape, strides, offset)`` of a returned tensor that lies inside one of the
        call's allocations (else inside exactly one of its tensors) with the same element size, ``offset`` in
        elements past the source's first one; ``None`` when there is none."""
        lo, hi = r.data_ptr(), r.data_ptr() + _span(r)
        n = len(self.tensors)
        found = [(n + i, a) for i, a in enumerate(self.allocs) if i not in kept and _inside(lo, hi, a)]
        if not found:
            found = [(i, t) for i, t in enumerate(self.tensors) if t is not None and _inside(lo, hi, t)]
        if len(found) != 1 or found[0][1].element_size() != r.element_size():
            return None
        src, base = found[0]
        if (lo - base.data_ptr()) % r.element_size():
            return None
        return ("view", src, r.dtype, tuple(r.shape), r.stride(), (lo - base.data_ptr()) // r.element_size())

    def plan(self, result):
        """The replay of what was recorded, or ``None`` where it would not be exact."""
        if self.unfit is not None:
            return None
        n = len(self.tensors)
        kept = {i for i, a in enumerate(self.allocs) if a.data_ptr() in _KEPT}
        allocs = [(tuple(a.shape), a.dtype, a.device) for a in self.allocs]
        returned = []
        for r in (result if isinstance(result, tuple) else () if result is None else (result,)):
            if r is None and isinstance(result, tuple):
                returned.append(None)
                continue
            if not isinstance(r, torch.Tensor):
                return None
            src = next((i for i, t in enumerate(self.tensors) if t is not None and _same(r, t)), None)
            if src is None:
                src = next((n + i for i, a in enumerate(self.allocs) if _same(r, a) and i not in kept), None)
            if src is None:  # a view of one of its allocations, else of one of its tensors
                src = self._view_of(r, kept)
            if src is None:
                return None
            returned.append(src)
        steps = []
        for ev in self.events:
            if ev[0] == "alloc":
                if ev[1] not in kept:
                    steps.append(("alloc",) + allocs[ev[1]] + (ev[2],))
                else:
                    steps.append(("none",))
            elif ev[0] == "zero":
                if ev[1] in kept:
                    return None
                steps.append(("zero", ev[1]))
            else:
                steps.append(ev)
        return _Plan(n, steps, tuple(returned), isinstance(result, tuple), self.device)


def _is_descriptor(v) -> bool:
    """Whether ``v`` is a host tensor descriptor (Triton's or Gluon's ``TensorDescriptor``) over a tensor."""
    return (isinstance(getattr(v, "base", None), torch.Tensor) and hasattr(v, "block_shape")
            and hasattr(v, "strides") and hasattr(v, "padding"))


class _Base:
    """A replayed descriptor's base: the launcher reads only its address."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Descriptor:
    """A host tensor descriptor made again at a replay: the fields the launcher reads."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding")

    def __init__(self, ptr: int, fields: tuple):
        self.base = _Base(ptr)
        self.shape, self.strides, self.block_shape, self.layout, self.padding = fields


def _same(a, b) -> bool:
    """Whether two tensors are the same view of the same memory (the dispatch mode sees an allocation as another
    Python object than the one its caller gets)."""
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def _inside(lo: int, hi: int, t: torch.Tensor) -> bool:
    """Whether bytes ``[lo, hi)`` lie within ``t``'s span."""
    return t.data_ptr() <= lo and hi <= t.data_ptr() + max(_span(t), 1)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, torch.dtype))


class _Plan:
    """A recorded call: ``plan(tensors)`` allocates as the call did and launches its compiled kernels directly."""

    __slots__ = ("n", "steps", "returned", "as_tuple", "device")

    def __init__(self, n, steps, returned, as_tuple, device):
        self.n, self.steps, self.returned, self.as_tuple, self.device = n, steps, returned, as_tuple, device

    def __call__(self, tensors):
        objs = list(tensors)
        bases = [None if t is None else t.data_ptr() for t in tensors]
        stream = None
        for st in self.steps:
            kind = st[0]
            if kind == "launch":
                _, run, function, metadata, g, template, ptrs, descs = st
                args = list(template)
                for pos, src, off in ptrs:
                    args[pos] = bases[src] + off
                for pos, src, off, fields in descs:
                    args[pos] = _Descriptor(off if src is None else bases[src] + off, fields)
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(self.device) if self.device >= 0 else 0
                run(g[0], g[1], g[2], stream, function, metadata, None, None, None, *args)
            elif kind == "alloc":
                t = (torch.zeros if st[4] else torch.empty)(st[1], dtype=st[2], device=st[3])
                objs.append(t)
                bases.append(t.data_ptr())
            elif kind == "zero":
                objs[self.n + st[1]].zero_()
            else:  # a kept buffer the recorded call allocated: not allocated again
                objs.append(None)
                bases.append(None)
        out = tuple(_returned(objs, r) for r in self.returned)
        return out if self.as_tuple else out[0] if out else None


def _returned(objs: list, r):
    """One returned value of a replay: a tensor or allocation by its index, a view of one, or ``None``."""
    if r is None or isinstance(r, int):
        return None if r is None else objs[r]
    _, src, dtype, shape, strides, offset = r
    base = objs[src]
    if base.dtype != dtype:
        base = base.view(dtype)
    return base.as_strided(shape, strides, base.storage_offset() + offset)
