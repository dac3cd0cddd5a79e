"""Launch plans (dsa._replay): a recorded call replayed on other tensors.

On the CPU the recorder runs on CPU tensors with a stand-in kernel, whose launcher receives exactly what a compiled
kernel's would: the tests check every pointer, scalar, grid and allocation of the replay. On a GPU, eager
``sparse_mla`` calls replayed from plans are compared bitwise with the same calls with plans off, on fresh tensors
at other addresses, over each decode path (the bulk kernel, the Hopper kernel with its merge in clusters or in the
merge kernel, the portable kernel), and inside a CUDA-graph capture."""
import inspect

import pytest
import torch

import dsa.backend
from dsa import _replay


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Jit:
    """Stands in for a JIT function: its parameters (``x``, ``y``, ``o``, ``n``, ``scale``, constexpr ``B``)."""
    params = [_Param("x"), _Param("y"), _Param("o"), _Param("n"), _Param("scale"), _Param("B", 4)]


class _Kernel:
    """Stands in for a compiled kernel: its launcher records what it is given."""

    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], 1234, (4, 1, 0)

    def _init_handles(self):
        pass

    def run(self, *args):
        self.calls.append(args)


def _recorded(tensors, body):
    """``body(recorder)`` as the recorded call of ``tensors``; returns the plan (or None) and the result."""
    key = ("test", tuple(_replay.tensor_key(t) for t in tensors))

    def fn():
        return body(_replay._LOCAL.recorder)
    result = _replay.record(key, tensors, fn)
    return _replay.lookup(key), result


def _call(kernel, rec, x, y, out, n=8, grid=(3, 2), **kw):
    """What an op's path does: allocations, zeroed ones (by ``torch.zeros`` and by ``zero_``), views of its tensors,
    launches."""
    part = torch.empty(5, 7, dtype=torch.float32)
    counters = torch.zeros(6, dtype=torch.int32)
    ml = torch.empty(4, dtype=torch.float32).zero_()
    rec.launch(_Jit, grid, (x[1:], y.view(torch.uint8)[:, 4:], part, n, 0.5), dict(num_warps=4, **kw), kernel)
    rec.launch(_Jit, (9,), (counters, ml, out, n + 1, 2.0), dict(B=8), kernel)
    return out, ml, counters


def test_replay_moves_every_pointer_and_repeats_the_allocations():
    kernel = _Kernel()
    x, y, out = torch.randn(6, 3), torch.randn(4, 8), torch.empty(2, 2)
    plan, (o1, ml1, c1) = _recorded((x, y, out, None), lambda rec: _call(kernel, rec, x, y, out))
    assert plan is not None and o1 is out
    assert len(kernel.calls) == 0  # (the stand-in's launches were only recorded)
    x2, y2, out2 = torch.randn(6, 3), torch.randn(4, 8), torch.empty(2, 2)
    c1.fill_(5)  # the recorded call's buffers are not reused
    o2, ml2, c2 = plan((x2, y2, out2, None))
    assert o2 is out2 and ml2.shape == (4,) and ml2.dtype == torch.float32 and c2.dtype == torch.int32
    assert (ml2 == 0).all() and [s[0] for s in plan.steps] == ["alloc", "alloc", "alloc", "zero", "launch", "launch"]
    assert c2.shape == (6,) and (c2 == 0).all() and c2.data_ptr() != c1.data_ptr()
    (g1, g2, g3, stream, fn, meta, lm, h1, h2, *a1), (b1, b2, b3, _, _, _, _, _, _, *a2) = kernel.calls
    assert (g1, g2, g3, fn, meta, lm, h1, h2) == (3, 2, 1, 1234, (4, 1, 0), None, None, None) and stream == 0
    assert (b1, b2, b3) == (9, 1, 1)
    assert a1[0] == x2.data_ptr() + x2.stride(0) * 4 and a1[1] == y2.data_ptr() + 4
    assert a1[2] not in (x2.data_ptr(), y2.data_ptr()) and a1[3:] == [8, 0.5, 4]  # (the constexpr's default)
    assert a2 == [c2.data_ptr(), ml2.data_ptr(), out2.data_ptr(), 9, 2.0, 8]


def test_kept_buffer_keeps_its_address():
    kernel = _Kernel()
    zero = _replay.keep(torch.zeros(16, dtype=torch.uint8))
    x = torch.randn(4)

    def body(rec):
        rec.launch(_Jit, (1,), (x, zero[8:], x, 1, 1.0), {}, kernel)
        return x
    plan, _ = _recorded((x,), body)
    x2 = torch.randn(4)
    assert plan((x2,)) is x2
    assert kernel.calls[0][9:12] == (x2.data_ptr(), zero.data_ptr() + 8, x2.data_ptr())


def test_returned_views_and_tensor_descriptors_replay():
    """A call may return views of its allocations (with another dtype of the same element size) and of its tensors,
    and ``None`` inside a tuple; a host tensor descriptor argument is made again over the replay's base pointer with
    the recorded shape, strides and block."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kernel = _Kernel()
    x, y = torch.randn(8, 4), torch.randint(0, 255, (32,), dtype=torch.uint8)

    def body(rec):
        a = torch.empty(2, 8)
        desc = TensorDescriptor(x[4:], [4, 4], [4, 1], [2, 4])
        rec.launch(_Jit, (1,), (a, desc, y, 3, 1.0), {}, kernel)
        return a[:, :5], a.view(torch.int32)[1], None, y[16:24].view(torch.int8)
    plan, first = _recorded((x, y), body)
    assert plan is not None
    x2, y2 = torch.randn(8, 4), torch.randint(0, 255, (32,), dtype=torch.uint8)
    a5, row, none, yv = plan((x2, y2))
    assert none is None and a5.shape == (2, 5) and a5.stride() == (8, 1) and a5.dtype == torch.float32
    assert row.dtype == torch.int32 and row.shape == (8,) and row.data_ptr() == a5.data_ptr() + 32
    assert a5.data_ptr() != first[0].data_ptr()
    assert yv.dtype == torch.int8 and yv.data_ptr() == y2.data_ptr() + 16
    assert torch.equal(yv.view(torch.uint8), y2[16:24])
    d = kernel.calls[-1][10]
    assert d.base.data_ptr() == x2[4:].data_ptr() and (list(d.shape), list(d.strides), list(d.block_shape),
                                                       d.padding) == ([4, 4], [4, 1], [2, 4], "zero")
    assert kernel.calls[-1][9] == a5.data_ptr() and kernel.calls[-1][11] == y2.data_ptr()


def test_planned_slack_and_nested_ops(monkeypatch):
    """``slack``: the bytes of a tensor's storage past its end (up to 16) join the signature, so a call over a row
    padded in its storage and one that ends the storage do not share a plan. A planned op called while another op
    records is part of that recording: it runs as it is, and is not recorded on its own."""
    kernel, calls = _Kernel(), []

    def inner(x):
        calls.append("inner")
        rec = _replay._LOCAL.recorder
        rec.launch(_Jit, (1,), (x, x, x, 2, 1.0), {}, kernel)
        return x

    p_inner = _replay.planned(inner)

    def outer(x, n):
        calls.append("outer")
        return p_inner(x)

    p_outer = _replay.planned(slack=("x",))(outer)
    monkeypatch.setattr(_replay, "_on_gpu", lambda t: True)
    _replay.set_enabled(True)
    try:
        big = torch.randn(4, 8)
        padded, ends = big[:, :6], big[:, 2:]
        assert _replay._slack(padded) == 8 and _replay._slack(ends) == 0 and _replay._slack(big[:2]) == 16
        assert p_outer(padded, 1) is padded and calls == ["outer", "inner"]
        assert p_outer(padded, 1) is padded and calls == ["outer", "inner"] and len(kernel.calls) == 1  # replayed
        p_outer(ends, 1)  # (its own signature: recorded)
        assert calls[2:] == ["outer", "inner"] and len(_replay._PLANS) == 2 and inner not in _replay._RECORDED
    finally:
        _replay.set_enabled(None)


_POINTER = "a pointer into {} of the call's tensors, allocations and kept buffers"
_WHY = {"copy": "runs aten.copy_.default", "foreign pointer": _POINTER.format(0), "aliased tensors": _POINTER.format(2),
        "callable grid": "a callable grid", "other tensor returned": "returns other tensors",
        "wider view returned": "returns other tensors"}


@pytest.mark.parametrize("case", ["copy", "foreign pointer", "aliased tensors", "callable grid",
                                  "other tensor returned", "wider view returned"])
def test_calls_that_would_not_replay_exactly_get_no_plan(case):
    kernel = _Kernel()
    x, y = torch.randn(8, 4), torch.randn(3)
    tensors = (x, x[2:] if case == "aliased tensors" else y)
    stranger = torch.randn(5)

    def body(rec):
        o = torch.empty(3)
        if case == "copy":
            o.copy_(y)
        ptr = stranger if case == "foreign pointer" else (x[3:] if case == "aliased tensors" else y)
        grid = (lambda meta: (1,)) if case == "callable grid" else (1,)
        rec.launch(_Jit, grid, (x, ptr, o, 2, 1.0), {}, kernel)
        if case == "wider view returned":  # (int32 over float32 storage is fine; int16 halves the element size)
            return o.view(torch.int16)
        return stranger if case == "other tensor returned" else o
    plan, result = _recorded(tensors, body)
    assert plan is None and isinstance(result, torch.Tensor)
    why = _replay.why(("test", tuple(_replay.tensor_key(t) for t in tensors)))
    assert why == _WHY[case], why


def test_plans_are_off_under_the_interpreter_and_with_a_launch_hook():
    from triton import knobs

    from dsa.backend import interpreter_on

    if interpreter_on():
        assert not _replay.enabled()
    try:
        _replay.set_enabled(False)
        assert not _replay.enabled()
        _replay.set_enabled(True)
        assert _replay.enabled()
        hook = lambda metadata: None  # noqa: E731  (a profiler's)
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert not _replay.enabled()
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert _replay.enabled()
    finally:
        _replay.set_enabled(None)


def test_planned_signatures(monkeypatch):
    """What a planned op's signature holds (a bool is not the int 1; an argument that does not hash runs the op as
    it is), and when new signatures are recorded: past :data:`~dsa._replay.RECORD_FREELY` recordings, only while
    the op's plans are replayed at least as often as it records."""
    kernel, calls = _Kernel(), []

    def op(x, n, extra=None):
        calls.append(n)
        o = torch.empty(4)
        if extra == "copy":
            o.copy_(x)
        rec = getattr(_replay._LOCAL, "recorder", None)
        if rec is not None:
            rec.launch(_Jit, (1,), (x, x, o, 1, 1.0), {}, kernel)
        return o

    planned = _replay.planned(op)
    monkeypatch.setattr(_replay, "_on_gpu", lambda t: True)
    monkeypatch.setattr(_replay, "RECORD_FREELY", 3)
    _replay.set_enabled(True)
    try:
        x = torch.randn(4)
        planned(x, 1)
        planned(x, 1)  # replayed
        planned(x, True)  # another signature
        assert calls == [1, True] and len(kernel.calls) == 1
        for _ in range(3):  # recorded once, as not replaying
            planned(x, 2, extra="copy")
        assert calls[2:] == [2, 2, 2] and _replay._RECORDED[op] == 3 and _replay._REPLAYED[op] == 1
        planned(x, 3)
        planned(x, 3)  # (3 recorded, 1 replayed: neither recorded)
        assert calls[5:] == [3, 3] and len(_replay._PLANS) == 3 and len(kernel.calls) == 1
        for _ in range(2):
            planned(x, 1)  # replayed: 3 now
        planned(x, 3)  # recorded
        planned(x, 3)  # replayed
        assert calls[7:] == [3] and _replay._RECORDED[op] == 4 and len(kernel.calls) == 4
        planned(x, 1, extra={"a": 1})  # (does not hash)
        assert calls[-1] == 1 and len(calls) == 9 and len(_replay._PLANS) == 4
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        planned(x, 1)  # (traced by torch.compile: the op itself)
        assert calls[-1] == 1 and len(calls) == 10 and len(kernel.calls) == 4
    finally:
        _replay.set_enabled(None)


def test_every_public_op_that_launches_kernels_is_planned():
    """Each op of ``dsa.__all__`` that launches kernels replays its eager calls; the two that do not are the host's
    chunk splitter and the torch Hadamard transform."""
    import dsa

    unplanned = sorted(n for n in dsa.__all__ if not hasattr(getattr(dsa, n), "unplanned"))
    assert unplanned == ["hadamard_128", "split_prefill_chunks"], unplanned


def test_dispatch_variables_join_the_signature(monkeypatch):
    """Each variable of :data:`dsa.backend.DISPATCH_ENV`, set, changed or removed through ``os.environ`` between
    calls, gives another signature: the call is recorded again, not replayed from the plan of another setting. A call
    for the PyTorch reference (``DSA_BACKEND`` or ``backend=``) runs the op, unrecorded."""
    import dsa.backend

    kernel, calls = _Kernel(), []

    def op(x, backend=None):
        calls.append(1)
        rec = _replay._LOCAL.recorder
        if rec is not None:
            rec.launch(_Jit, (1,), (x, x, x, 1, 1.0), {}, kernel)
        return x

    planned = _replay.planned(op)
    monkeypatch.setattr(_replay, "_on_gpu", lambda t: True)
    for v in dsa.backend.DISPATCH_ENV:
        monkeypatch.delenv(v, raising=False)
    _replay.set_enabled(True)
    try:
        x = torch.randn(4)
        planned(x)
        planned(x)  # replayed
        assert len(calls) == 1 and len(kernel.calls) == 1
        for n, v in enumerate(dsa.backend.DISPATCH_ENV):
            monkeypatch.setenv(v, "1")
            planned(x)  # recorded
            monkeypatch.setenv(v, "0")
            planned(x)  # recorded
            planned(x)  # replayed
            assert len(calls) == 3 + 2 * n and len(kernel.calls) == 2 + n
        for v in dsa.backend.DISPATCH_ENV:
            monkeypatch.delenv(v)
        planned(x)  # the first signature again: replayed
        assert len(calls) == 7 and len(kernel.calls) == 5
        n = len(_replay._PLANS)
        monkeypatch.setenv("DSA_BACKEND", "Reference")  # (the PyTorch reference: the op as it is, not recorded)
        planned(x)
        monkeypatch.delenv("DSA_BACKEND")
        planned(x, backend="reference")
        assert len(calls) == 9 and len(kernel.calls) == 5 and len(_replay._PLANS) == n
    finally:
        _replay.set_enabled(None)


def test_sparse_mla_wrapper_records_only_what_replays(monkeypatch):
    """The public wrapper's own path (checks, views, dispatch) with its kernels stood in for: recorded once, then
    replayed on fresh tensors without running the wrapper again; a call with another signature (here ``sm_scale``
    given as a bool, or q of another dtype) takes the wrapper's path and its checks."""
    from dsa import sparse_mla
    from dsa.mla import kernel as K
    from dsa.mla.epilogue import outputs

    kernel, ran = _Kernel(), []

    def stub(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, out):
        ran.append(kv.shape)
        res = outputs(q.shape[0], q.shape[1], d_v, q.device, out)
        _replay._LOCAL.recorder.launch(_Jit, (q.shape[0],), (q, kv[:, 512:], indices, 7, sm_scale), {}, kernel)
        return res

    monkeypatch.setattr(K, "sparse_mla_triton", stub)
    monkeypatch.setattr(_replay, "_on_gpu", lambda t: True)
    # (the wrapper's Triton path on these CPU tensors on any machine, the interpreter's or a GPU machine's)
    monkeypatch.setattr(dsa.backend, "triton_runs_on", lambda device: True)
    _replay.set_enabled(True)
    try:
        def inputs():
            q = torch.randn(3, 16, 576).to(torch.bfloat16)
            kv = torch.randn(2, 64, 576).to(torch.bfloat16)  # (paged: the wrapper flattens it)
            return q, kv, torch.randint(0, 128, (3, 32), dtype=torch.int32), torch.empty(3, 16, 512,
                                                                                          dtype=torch.bfloat16)
        q, kv, idx, out = inputs()
        sparse_mla(q, kv, idx, 0.5, out=out)
        assert ran == [(128, 576)] and len(_replay._PLANS) == 1
        q2, kv2, idx2, out2 = inputs()
        o, ml, lse = sparse_mla(q2, kv2, idx2, 0.5, out=out2)
        assert ran == [(128, 576)] and o is out2 and ml.shape == lse.shape == (3, 16) and ml.dtype == torch.float32
        assert kernel.calls[0][9:14] == (q2.data_ptr(), kv2.data_ptr() + 1024, idx2.data_ptr(), 7, 0.5)
        with pytest.raises(TypeError, match="sm_scale"):
            sparse_mla(q2, kv2, idx2, True, out=out2)
        with pytest.raises(TypeError, match="q: expected dtype bfloat16"):
            sparse_mla(q2.float(), kv2, idx2, 0.5, out=out2)
    finally:
        _replay.set_enabled(None)


# ---------------------------------------------------------------- GPU: sparse_mla replayed against its own path

DECODE = [  # (cache format, h_q, batch, topk): the bulk kernel, the Hopper kernel (clusters / merge kernel), ...
    ("fp8_ds_mla", 16, 64, 2048),
    ("fp8_ds_mla", 32, 64, 2048),
    ("bf16", 16, 32, 2048),
    ("fp8_ds_mla", 128, 1, 2048),
    ("bf16", 64, 4, 576),
    ("fp8_ds_mla", 8, 3, 100),
    ("bf16", 24, 5, 333),
]


def _inputs(fmt, h, B, topk, seed, with_extras):
    from dsa.bench import mla_inputs

    q, kv, idx = mla_inputs(B, h, topk, B, 4096, fmt, dev="cuda", seed=seed)[:3]
    kv = kv.reshape(-1, kv.shape[-1])
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    idx[:, ::7] = -1
    idx[:, 3::11] = kv.shape[0] + 5
    sink = torch.randn(h, device="cuda", generator=g) if with_extras else None
    lens = torch.randint(0, topk + 1, (B,), device="cuda", generator=g).to(torch.int32) if with_extras else None
    return q, kv, idx, sink, lens


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,h,B,topk", DECODE)
@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("give_out", [False, True])
def test_gpu_sparse_mla_replayed_matches_its_own_path(fmt, h, B, topk, extras, give_out):
    from triton.runtime.jit import JITFunction

    from dsa import sparse_mla

    sm = 576 ** -0.5
    runs, alive = [], []
    for seed in (1, 2, 3):
        q, kv, idx, sink, lens = _inputs(fmt, h, B, topk, seed, extras)
        alive.append((q, kv, idx, sink, lens))  # (each call's tensors at addresses of their own)
        out = torch.full((B, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda") if give_out else None
        _replay.set_enabled(False)
        want = [t.clone() for t in sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=lens, out=out)]
        _replay.set_enabled(None)
        if out is not None:
            out.fill_(float("nan"))
        if seed == 1:  # recorded
            got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=lens, out=out)
        else:  # replayed: nothing goes through Triton's JIT
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(JITFunction, "run", lambda *a, **k: pytest.fail(
                    f"launched through the JIT: {[_replay.why(k) for k, _ in _replay._PLANS]}"))
                got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=lens, out=out)
        runs.append((want, got, out))
    keys = [k for k, _ in _replay._PLANS if k[0] is sparse_mla.unplanned]
    assert len(keys) == 1
    assert _replay.lookup(keys[0]) is not None, f"no plan: {_replay.why(keys[0])}"
    for want, got, out in runs:
        if out is not None:
            assert got[0] is out
        for w, g in zip(want, got):
            assert torch.equal(w, g)


@pytest.mark.gpu
def test_gpu_sparse_mla_replayed_inside_a_graph():
    from dsa import sparse_mla

    sm = 0.07
    q, kv, idx, sink, lens = _inputs("fp8_ds_mla", 32, 16, 2048, 4, True)
    want = [t.clone() for t in sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=lens)]  # recorded
    assert _replay._PLANS and all(_replay.lookup(k) is not None for k, _ in _replay._PLANS)
    out = torch.empty(16, 32, 512, dtype=torch.bfloat16, device="cuda")
    sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=lens, out=out)  # recorded (with out)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=lens, out=out)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.gpu
def test_gpu_sparse_mla_sliced_heads_runs_its_own_path(monkeypatch):
    """Over 64 heads in slices the call copies each slice's max_logits and lse into its own: no plan; every call
    takes the op's path, whose results stay those of the call with plans off."""
    from dsa import sparse_mla
    from dsa.mla import kernel as K

    if K.kernel_sm90 is None or not torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("the sliced heads serve Hopper")
    sm = 576 ** -0.5
    q, kv, idx, sink, lens = _inputs("bf16", 96, 8, 512, 5, False)
    monkeypatch.setattr(K, "SLICE_MIN_T", {True: 1, False: 1})
    _replay.set_enabled(False)
    want = sparse_mla(q, kv, idx, sm)
    _replay.set_enabled(None)
    for _ in range(2):
        got = sparse_mla(q, kv, idx, sm)
        for w, g in zip(want, got):
            assert torch.equal(w, g)
    assert _replay._PLANS and all("runs aten.copy_" in _replay.why(k) for k, _ in _replay._PLANS)


@pytest.mark.gpu
@pytest.mark.parametrize("indexer", ["fp8", "bf16"])
def test_gpu_engine_eager_steps_replayed_match_plans_off(indexer):
    """The engine's eager steps (decode as the fixed-shape step of the CUDA-graph path, run eagerly: one signature
    step after step) give the same tokens with plans on as with plans off, and every planned op the steps call
    records plans that replay (none refused). Prints which planned ops replay (and why the others do not)."""
    from dsa.engine import Engine, EngineConfig
    from dsa.model.tiny import random_model, tiny_config

    m = random_model(tiny_config(num_hidden_layers=2), seed=0).to("cuda")
    m.set_options(indexer_dtype=indexer, kv_format="fp8_ds_mla" if indexer == "fp8" else "bf16")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (300, 45, 9, 700)]
    outs = {}
    for plans in (False, None):
        _replay.clear()
        _replay.set_enabled(plans)
        eng = Engine(m, EngineConfig(ignore_eos=True, block_size=64, num_blocks=64, max_num_batched_tokens=256,
                                     max_num_seqs=4, max_prefill_chunk=100, cuda_graph="static"))
        for i, p in enumerate(prompts):
            eng.add_request(p, 12, arrival_step=2 * i)
        outs[plans] = [r.output for r in eng.run()]
    _replay.set_enabled(None)
    assert outs[None] == outs[False]
    status = {}
    for (key, _), plan in _replay._PLANS.items():
        status.setdefault(key[0].__name__, set()).add("replays" if _replay.lookup(key) is not None
                                                       else _replay.why(key))
    print(f"\nREPLAY STATUS {indexer}: {status}")
    want = {"sparse_mla", "concat_and_cache_mla", "top_k_indices", "generate_sparse_seqlen",
            "convert_req_index_to_global_index"}
    if indexer == "fp8":
        want |= {"prepare_indexer_q", "prepare_indexer_k", "indexer_k_quant_and_cache", "fp8_paged_mqa_logits",
                 "gather_indexer_k", "fp8_mqa_logits"}
    assert want <= set(status) and all(v == {"replays"} for v in status.values()), status


# ---------------------------------------------------------------- GPU: every other planned op against its own path
def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _bf16(g, *shape):
    return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)


def _fp8(g, *shape):
    return (torch.randn(*shape, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)


def _slots(g, n, S):
    """``n`` int64 slots below ``S``, with -1 and ``>= S`` entries among them."""
    s = torch.randperm(S, device="cuda", generator=g)[:n].to(torch.int64)
    s[::5] = -1
    s[3::7] = S + 2
    return s


def _block_table(g, B, max_blocks, num_blocks):
    bt = torch.randint(0, num_blocks, (B, max_blocks), device="cuda", generator=g, dtype=torch.int32)
    bt[:, -1] = -1
    return bt


def _indexer_cache(g, nb, bs):
    """``[nb, bs * 132]`` uint8: random fp8 keys, then each block's fp32 scales in [0.5, 1.5)."""
    cache = torch.randint(0, 255, (nb, bs * 132), device="cuda", generator=g, dtype=torch.uint8)
    cache[:, bs * 128:] = (torch.rand(nb, bs, device="cuda", generator=g) + 0.5).view(torch.uint8).view(nb, -1)
    return cache


def _op_cases():
    """(name, op, inputs(seed) -> (args, kwargs, tensors the call writes in place)); each case's calls share one
    signature."""
    import dsa.indexer_cache as IC
    import dsa.indexer_prep as IP
    import dsa.metadata as MD
    import dsa.mla_cache as MC
    import dsa.mqa_logits as ML
    import dsa.topk as TK

    def mla_cache(fmt):
        def inputs(seed):
            g = _gen(seed)
            width, dt = (656, torch.uint8) if fmt == "fp8_ds_mla" else (576, torch.bfloat16)
            cache = (torch.randint(0, 255, (8, 64, width), device="cuda", generator=g, dtype=torch.uint8)
                     if dt == torch.uint8 else _bf16(g, 8, 64, width))
            return (_bf16(g, 37, 512), _bf16(g, 37, 64), cache, _slots(g, 37, 512), fmt), {}, [cache]
        return inputs

    def quantize(seed):
        g = _gen(seed)
        return (_bf16(g, 45, 512), _bf16(g, 45, 64)), {}, []

    def dequantize(seed):
        g = _gen(seed)
        rows = MC.quantize_fp8_ds_mla.unplanned(_bf16(g, 45, 512), _bf16(g, 45, 64))
        return (rows.view(3, 15, 656),), {}, []

    def k_quant(seed):
        return (_bf16(_gen(seed), 3, 41, 128),), {}, []

    def k_quant_cache(seed):
        g = _gen(seed)
        cache = _indexer_cache(g, 6, 64)
        return (_bf16(g, 29, 128), cache, _slots(g, 29, 384)), {"scale_fmt": None}, [cache]

    def gather(seed):
        g = _gen(seed)
        bt = torch.randint(0, 6, (3, 4), device="cuda", generator=g, dtype=torch.int32)
        cu = torch.tensor([0, 70, 70, 190], dtype=torch.int32, device="cuda")
        return (_indexer_cache(g, 6, 64), bt, cu), {"num_tokens": 190}, []

    def prep_q(seed):
        g = _gen(seed)
        T = 19
        return ((_bf16(g, T, 64, 128), torch.randn(T, 32, device="cuda", generator=g),
                 torch.randn(T, 32, device="cuda", generator=g), _bf16(g, T, 64)),
                {"hadamard": True, "return_scale": True}, [])

    def prep_k(seed):
        g = _gen(seed)
        T = 23
        return ((_bf16(g, T, 128), torch.randn(T, 32, device="cuda", generator=g),
                 torch.randn(T, 32, device="cuda", generator=g)), {"interleaved": True}, [])

    def convert(seed):
        g = _gen(seed)
        T, K = 9, 96
        idx = torch.randint(-1, 300, (T, K), device="cuda", generator=g, dtype=torch.int32)
        req = torch.randint(0, 3, (T,), device="cuda", generator=g, dtype=torch.int32)
        return (req, _block_table(g, 3, 5, 40), idx, 64), {"return_valid_counts": True}, []

    def sparse_seqlen(seed):
        qsl = torch.tensor([0, 1, 5, 6], dtype=torch.int32, device="cuda")
        lens = torch.randint(6, 3000, (3,), device="cuda", generator=_gen(seed), dtype=torch.int32)
        return (qsl, lens, 2048), {"num_tokens": 6}, []

    def topk_decode(seed):
        g = _gen(seed)
        B, N = 6, 3001
        logits = torch.randn(B, (N + 3) // 4 * 4, device="cuda", generator=g)[:, :N]  # (as the indexer's)
        lens = torch.randint(1, N + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
        return ((logits, 512), {"seq_lens": lens, "block_table": _block_table(g, B, 48, 100), "block_size": 64},
                [])

    def topk_ranges(seed):
        g = _gen(seed)
        M, N = 5, 20000
        logits = torch.randn(M, N, device="cuda", generator=g)
        ks = torch.randint(0, 5000, (M,), device="cuda", generator=g, dtype=torch.int32)
        return (logits, 2048, ks, ks + 15000), {}, []

    def paged_logits(seed):
        g = _gen(seed)
        B, next_n, nb = 4, 2, 40
        lens = torch.randint(1, 1100, (B,), device="cuda", generator=g, dtype=torch.int32)
        return ((_fp8(g, B, next_n, 64, 128), _indexer_cache(g, nb, 64), torch.randn(B * next_n, 64, device="cuda",
                                                                                      generator=g),
                 lens, _block_table(g, B, 20, nb), 1100), {}, [])

    def prefill_logits(seed):
        g = _gen(seed)
        M, N = 70, 900
        ks = torch.randint(0, 300, (M,), device="cuda", generator=g, dtype=torch.int32)
        kv = (_fp8(g, N, 128), torch.rand(N, device="cuda", generator=g))
        return ((_fp8(g, M, 64, 128), kv, torch.randn(M, 64, device="cuda", generator=g), ks, ks + 500), {}, [])

    return [
        ("concat_and_cache_mla fp8", MC.concat_and_cache_mla, mla_cache("fp8_ds_mla")),
        ("concat_and_cache_mla bf16", MC.concat_and_cache_mla, mla_cache("bf16")),
        ("quantize_fp8_ds_mla", MC.quantize_fp8_ds_mla, quantize),
        ("dequantize_fp8_ds_mla", MC.dequantize_fp8_ds_mla, dequantize),
        ("indexer_k_quant", IC.indexer_k_quant, k_quant),
        ("indexer_k_quant_and_cache", IC.indexer_k_quant_and_cache, k_quant_cache),
        ("gather_indexer_k", IC.gather_indexer_k, gather),
        ("prepare_indexer_q", IP.prepare_indexer_q, prep_q),
        ("prepare_indexer_k", IP.prepare_indexer_k, prep_k),
        ("convert_req_index_to_global_index", MD.convert_req_index_to_global_index, convert),
        ("generate_sparse_seqlen", MD.generate_sparse_seqlen, sparse_seqlen),
        ("top_k_indices decode", TK.top_k_indices, topk_decode),
        ("top_k_indices ranges", TK.top_k_indices, topk_ranges),
        ("fp8_paged_mqa_logits", ML.fp8_paged_mqa_logits, paged_logits),
        ("fp8_mqa_logits", ML.fp8_mqa_logits, prefill_logits),
    ]


def _flat(result):
    if result is None:
        return []
    return [r for r in (result if isinstance(result, tuple) else (result,)) if r is not None]


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


def _bits(t):
    """``t``'s bits (NaN compares equal to the same NaN)."""
    return t.view(_BITS.get(t.dtype, t.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c[0] for c in _op_cases()])
def test_gpu_planned_op_replayed_matches_its_own_path(case):
    """Each planned op: three calls of one signature on fresh inputs (the first recorded, the others replayed
    without Triton's JIT) give bitwise what the same calls give with plans off: returned tensors (views included:
    shape, strides, dtype, and every element) and the tensors written in place."""
    from triton.runtime.jit import JITFunction

    name, op, inputs = next(c for c in _op_cases() if c[0] == case)
    alive = []
    for seed in (11, 12, 13):
        args, kwargs, written = inputs(seed)
        _replay.set_enabled(False)
        want = [(t.shape, t.stride(), t.dtype, _bits(t).clone()) for t in _flat(op(*args, **kwargs)) + written]
        _replay.set_enabled(None)
        args, kwargs, written = inputs(seed)  # (the same values, at other addresses)
        alive.append((args, written))
        if seed == 11:
            result = op(*args, **kwargs)
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(JITFunction, "run", lambda *a, **k: pytest.fail(
                    f"{name}: launched through the JIT: {[_replay.why(k) for k, _ in _replay._PLANS]}"))
                result = op(*args, **kwargs)
        got = _flat(result) + written
        assert len(got) == len(want), name
        for (shape, stride, dtype, w), g in zip(want, got):
            assert (g.shape, g.stride(), g.dtype) == (shape, stride, dtype), name
            assert torch.equal(w, _bits(g)), name
    keys = [k for k, _ in _replay._PLANS if k[0] is op.unplanned]
    assert len(keys) == 1 and _replay.lookup(keys[0]) is not None, (name, [_replay.why(k) for k in keys])


def test_dsa_run_reports_the_timed_runs_plans():
    """``dsa run``'s report counts the launch plans of its timed run: the difference of two :func:`stats`
    snapshots, summed over the ops, refusals by op and reason; the text report prints it in one line."""
    from dsa import pipeline

    before = {"sparse_mla": {"recorded": 2, "replayed": 10, "unfit": {}},
              "top_k_indices": {"recorded": 1, "replayed": 0, "unfit": {"runs aten.copy_.default": 1}}}
    after = {"sparse_mla": {"recorded": 3, "replayed": 50, "unfit": {}},
             "top_k_indices": {"recorded": 3, "replayed": 4, "unfit": {"runs aten.copy_.default": 2}},
             "concat_and_cache_mla": {"recorded": 1, "replayed": 7, "unfit": {}}}
    delta = pipeline._plans_delta(before, after)
    assert delta == {"replayed": 51, "recorded": 4, "refused": {"top_k_indices: runs aten.copy_.default": 1}}
    wl = pipeline.Workload(prompt_lens=[5], decode_steps=2, num_heads=16, topk=64, layers=1, hidden=64,
                           q_lora_rank=32, intermediate=64, vocab=64, max_num_batched_tokens=64, max_num_seqs=1)
    rep = pipeline.run(wl, torch.device("cpu"), progress=False)
    assert rep.plans is None and "launch plans" not in pipeline.format_report(rep)  # (off on the CPU)
    rep.plans = delta
    text = pipeline.format_report(rep)
    assert ("launch plans (eager op calls; dsa/_replay.py): 51 calls replayed, 4 signatures recorded, refused: "
            "top_k_indices: runs aten.copy_.default (1)") in text
    rep.plans = {"replayed": 1234, "recorded": 0, "refused": {}}
    assert "1,234 calls replayed, 0 signatures recorded, none refused" in pipeline.format_report(rep)
