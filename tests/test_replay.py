"""Launch plans (dsa._replay): a recorded call replayed on other tensors.

On the CPU the recorder runs on CPU tensors with a stand-in kernel, whose launcher receives exactly what a compiled
kernel's would: the tests check every pointer, scalar, grid and allocation of the replay. On a GPU, eager
``sparse_mla`` calls replayed from plans are compared bitwise with the same calls with plans off, on fresh tensors
at other addresses, over each decode path (the bulk kernel, the Hopper kernel with its merge in clusters or in the
merge kernel, the portable kernel), and inside a CUDA-graph capture."""
import inspect

import pytest
import torch

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


_POINTER = "a pointer into {} of the call's tensors, allocations and kept buffers"
_WHY = {"copy": "runs aten.copy_.default", "foreign pointer": _POINTER.format(0), "aliased tensors": _POINTER.format(2),
        "callable grid": "a callable grid", "view returned": "returns other tensors"}


@pytest.mark.parametrize("case", ["copy", "foreign pointer", "aliased tensors", "callable grid", "view returned"])
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
        return o[1:] if case == "view returned" else o
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
    step after step) give the same tokens with plans on as with plans off, and sparse_mla's calls replay. Prints
    which planned ops replay (and why the others do not)."""
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
    assert status.get("sparse_mla") == {"replays"}, status
