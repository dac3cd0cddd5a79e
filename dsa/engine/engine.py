"""The serving engine: continuous batching with chunked prefill over a paged DSA cache.

    from dsa.engine import Engine, EngineConfig
    eng = Engine(model, EngineConfig(block_size=64, num_blocks=512, max_num_batched_tokens=2048))
    eng.add_request([1, 2, 3], max_new_tokens=32)
    eng.add_request(prompt, 64, arrival_step=5)      # arrives at the engine's 5th step
    finished = eng.run()                             # every request, finished or rejected
    finished[0].output, finished[0].ttft

One :meth:`Engine.step`: the scheduler (:mod:`dsa.engine.scheduler`) picks the decodes and the
prefill chunks, the step metadata is built once (:func:`dsa.model.build_step_metadata`), one
model forward runs every token of the step, and each request whose prompt is now fully cached
gets its next token (greedy by default; sampled with ``greedy=False``: the ``k``-th new token of the ``i``-th
request added is drawn with :func:`~dsa.sampling.row_seed` ``(seed, i, k)``, so it is the token
:func:`dsa.model.generate` draws for prompt ``i``, whatever the batching). Requests stop at
``max_new_tokens`` or at the config's EOS (unless ``ignore_eos``) and give their blocks back.
A pure-decode step on a GPU replays a CUDA graph (:mod:`dsa.engine.cuda_graph`) when the model
allows it.

With ``async_decode`` (the default) graph steps do not wait for their tokens, greedy or sampled (the graph picks
them): a step launches its graph, whose rows take the previous step's tokens on the
device, and only then reads the previous step's tokens (long done), so the host schedules and writes step N + 1
while the GPU runs step N. A token picked by the graph is a placeholder (-1) in ``tokens`` and ``output`` until
it is read. A request whose last token is in flight is not scheduled again; one that stops at EOS
is found a step late, and the extra token computed for it is dropped. Any other step first reads
the tokens in flight (:meth:`Engine.sync`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..model.metadata import RequestSpec, build_step_metadata
from ..sampling import row_seed, sample_tokens
from .block_manager import BlockManager
from .cuda_graph import DecodeGraphRunner, default_buckets, graph_unsupported_reason
from .profiler import StageProfiler
from .scheduler import FINISHED, RUNNING, Request, Scheduler, SchedulerConfig


@dataclass
class EngineConfig:
    block_size: int = 64
    num_blocks: int = 1024  # cache blocks (one more is kept as the CUDA-graph scratch block)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None  # default: what the cache can hold
    #: "auto" (capture on CUDA when the model allows), "capture", "static" (the graph path's padded
    #: fixed-shape step, run eagerly: for CPU tests), "off"
    cuda_graph: str = "auto"
    graph_buckets: list | None = None
    max_logits_bytes: int = 512 << 20
    profile: bool = False  # per-stage timing (StageProfiler)
    profile_decode_every: int = 16  # with graphs: every n-th decode step (the n/2-th first) runs eagerly, profiled
    check: bool = False  # recompute sampled steps with the reference backend
    check_max_tokens: int = 4096  # largest step re-run by check
    check_decode_every: int = 64
    greedy: bool = True
    #: CUDA-graph decode steps read their tokens a step late (see the module's docstring)
    async_decode: bool = True
    temperature: float = 1.0  # (with greedy=False; <= 0 is greedy)
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class StepRecord:
    index: int
    kind: str  # "prefill" | "mixed" | "decode" | "decode_graph"
    num_reqs: int
    num_tokens: int
    num_decodes: int
    seconds: float


@dataclass
class CheckRecord:
    step: int
    kind: str
    logits_max_abs_diff: float
    argmax_equal: bool
    topk_rows_equal: float | None = None  # fraction of (layer, token) selections equal as sets
    logits_max_rel_diff: float = 0.0  # largest difference / largest |reference logit|


class Engine:
    def __init__(self, model, cfg: EngineConfig | None = None):
        self.model = model
        self.cfg = cfg = cfg or EngineConfig()
        self.device = model.lm_head.weight.device
        mode = cfg.cuda_graph
        if mode not in ("auto", "capture", "static", "off"):
            raise ValueError(f"cuda_graph: expected 'auto', 'capture', 'static' or 'off', got {mode!r}")
        self.graph_note = None
        reason = graph_unsupported_reason(model)
        if reason is None and self.device.type == "cuda":
            from ..backend import resolve

            if resolve(model.backend, self.device) != "triton":
                reason = "the PyTorch reference ops synchronise with the host: decode runs eagerly"
        if mode == "auto":
            mode = "capture" if self.device.type == "cuda" and reason is None else "off"
            if self.device.type == "cuda" and reason is not None:
                self.graph_note = reason
        elif mode == "capture":
            if self.device.type != "cuda":
                raise ValueError("cuda_graph: 'capture' needs a CUDA device")
            if reason is not None:
                raise ValueError(f"cuda_graph: cannot capture this model: {reason}")
        if not 0.0 < cfg.top_p <= 1.0:
            raise ValueError(f"top_p: expected a value in (0, 1], got {cfg.top_p}")
        #: the sampling temperature (0: greedy)
        self.temperature = 0.0 if cfg.greedy else max(float(cfg.temperature), 0.0)
        self.graph_mode = mode
        reserved = 1 if mode in ("capture", "static") else 0
        self.cache = model.new_cache(cfg.num_blocks + reserved, cfg.block_size)
        self.blocks = BlockManager(cfg.num_blocks + reserved, cfg.block_size, reserved=reserved)
        max_len = cfg.max_model_len or self.blocks.capacity * cfg.block_size
        self.max_model_len = max_len
        self.sched = Scheduler(SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_prefill_chunk,
                                               cfg.max_model_len), self.blocks, model.config.vocab_size)
        self.graph = None
        if mode in ("capture", "static"):
            buckets = cfg.graph_buckets or default_buckets(cfg.max_num_seqs)
            self.graph = DecodeGraphRunner(model, self.cache, max_model_len=max_len, buckets=buckets,
                                           pad_block=self.blocks.reserved_ids[0], capture=mode == "capture",
                                           max_logits_bytes=cfg.max_logits_bytes, temperature=self.temperature,
                                           top_p=cfg.top_p)
            if mode == "capture":
                self.graph.capture_all()  # (at start-up: a capture inside a step would cost it tens of ms)
        self.profiler = StageProfiler(self.device) if cfg.profile else None
        eos = model.config.eos_token_id
        self.eos = set() if cfg.ignore_eos or eos is None else set(eos if isinstance(eos, list) else [eos])
        self.steps: list = []
        self.checks: list = []
        self.requests: list = []
        self._decode_steps = 0
        self._inflight = None  # the graph step whose tokens are not read yet: (rows [(row, request, k)], host, event)
        self.num_async_steps = 0  # graph steps that did not wait for their tokens (async_decode)
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, max_new_tokens: int, arrival_step: int = 0) -> Request:
        """Queue a request; one that can never be served comes back ``status == "rejected"`` with
        ``error`` saying why (the engine and the other requests are unaffected)."""
        r = Request(rid=len(self.requests), prompt=prompt, max_new_tokens=max_new_tokens,
                    arrival_step=max(int(arrival_step), self.sched.step_index))
        self.requests.append(r)
        return self.sched.add(r)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> StepRecord | None:
        s = self.sched
        if not s.running and s.waiting and all(r.arrival_step > s.step_index for r in s.waiting):
            s.step_index = min(r.arrival_step for r in s.waiting)  # idle until the next arrival
        t0 = time.perf_counter()
        t_start = self.now()
        for r in s.waiting:
            if r.t_arrival is None and r.arrival_step <= s.step_index:
                r.t_arrival = t_start
        admitted, sched = s.schedule()
        for r in admitted:
            if r.t_arrival is None:
                r.t_arrival = t_start
            if r.status == FINISHED:
                r.t_finish = t_start
        pure_decode = bool(sched) and all(n == 1 for _, n in sched)
        use_graph = self.graph is not None and pure_decode and len(sched) <= self.graph.max_batch
        every = max(self.cfg.profile_decode_every, 1)
        if use_graph and self.profiler is not None and self._decode_steps % every == every // 2:
            use_graph = False  # a sampled eager decode step gives the per-stage split
        check = self._want_check(pure_decode, sum(n for _, n in sched))
        go_async = use_graph and self._async_ok(check)
        if not go_async:
            self.sync()  # this step needs the tokens in flight on the host; one at EOS ends its request
            sched = [(r, n) for r, n in sched if r.status == RUNNING]
        if not sched:
            s.step_index += 1
            return None
        specs = [RequestSpec(r.num_computed, n, r.blocks) for r, n in sched]  # (read within the step)
        if go_async:
            return self._step_async(sched, specs, t0)
        if use_graph:
            kind = "decode_graph"
            ids = [r.tokens[r.num_computed] for r, _ in sched]
            if self.profiler is not None:
                self.profiler.enabled = False
            logits = self.graph.run(specs, ids, seeds=self._seeds(sched))
            if self.profiler is not None:
                self.profiler.enabled = True
            order = list(range(len(sched)))
            md = None
        else:
            kind = "decode" if pure_decode else ("prefill" if not any(n == 1 for _, n in sched) else "mixed")
            if check:
                self.model.set_record(True)
            md, ids_t = self._metadata(sched, specs)
            if self.profiler is not None:
                with self.profiler.step(kind):
                    logits = self._forward(ids_t, md)
            else:
                logits = self._forward(ids_t, md)
            order = md.order
        if pure_decode:
            self._decode_steps += 1
        # next tokens (one host sync per step)
        rows = []
        for j, i in enumerate(order):
            r, n = sched[i]
            r.num_computed += n
            if r.num_computed == len(r.tokens):
                rows.append((j, r))
        if use_graph:  # the graph picked them (as in an async step)
            host, evt = self.graph.fetch_tokens(len(sched))
            if evt is not None:
                evt.synchronize()
            toks = host.tolist()
            picked = [toks[j] for j, _ in rows]
        else:
            picked = self._pick(logits, rows)
        dt = time.perf_counter() - t0
        t_end = self.now()
        if check:
            self._check(sched, specs, logits, order, kind, md)
        for (j, r), tok in zip(rows, picked):
            r.tokens.append(tok)
            r.output.append(tok)
            if r.t_first_token is None:
                r.t_first_token = t_end
            if tok in self.eos or len(r.output) >= r.max_new_tokens:
                r.t_finish = t_end
                s.finish(r, "stop" if tok in self.eos else "length")
        rec = StepRecord(s.step_index, kind, len(sched), sum(n for _, n in sched),
                         sum(1 for _, n in sched if n == 1), dt)
        self.steps.append(rec)
        s.step_index += 1
        return rec

    def _async_ok(self, check: bool) -> bool:
        return self.cfg.async_decode and self.graph is not None and not check

    def _seed(self, r) -> int:
        """The seed of request ``r``'s next new token (its ``len(r.output)``-th)."""
        return row_seed(self.cfg.seed, r.rid, len(r.output))

    def _seeds(self, sched) -> list | None:
        """Per row of a graph step: the seed of its request's next token (None when greedy)."""
        return None if self.temperature <= 0 else [self._seed(r) for r, _ in sched]

    def _step_async(self, sched, specs, t0) -> StepRecord:
        """A graph step that does not wait for its tokens (``async_decode``): rows whose input token is still
        in flight take it on the device; then the previous step's tokens are read (:meth:`sync`)."""
        s = self.sched
        prev = {id(r): j for j, r, _ in self._inflight[0]} if self._inflight is not None else {}
        ids, src = [], []
        for r, _ in sched:
            tok = r.tokens[r.num_computed]
            ids.append(max(tok, 0))
            src.append(prev[id(r)] if tok < 0 else -1)
        if self.profiler is not None:
            self.profiler.enabled = False
        self.graph.run(specs, ids, src, self._seeds(sched))
        host, evt = self.graph.fetch_tokens(len(sched))
        if self.profiler is not None:
            self.profiler.enabled = True
        rows = []
        for j, (r, n) in enumerate(sched):
            r.num_computed += n
            if r.num_computed == len(r.tokens):  # a token is sampled for r: a placeholder until read
                rows.append((j, r, len(r.output)))
                r.tokens.append(-1)
                r.output.append(-1)
                r.last_in_flight = len(r.output) >= r.max_new_tokens  # (not scheduled again)
        self._decode_steps += 1
        self.num_async_steps += 1
        self.sync()
        self._inflight = (rows, host, evt)
        rec = StepRecord(s.step_index, "decode_graph", len(sched), len(sched), len(sched), time.perf_counter() - t0)
        self.steps.append(rec)
        s.step_index += 1
        return rec

    def sync(self) -> None:
        """Read the tokens of the graph step still in flight (``async_decode``), if any: they replace their
        placeholders, and a request that reached EOS or its length finishes (tokens computed for it after an EOS
        are dropped). :meth:`run` ends with it; call it after your own :meth:`step` calls."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        rows, host, evt = inflight
        if evt is not None:
            evt.synchronize()
        toks = host.tolist()
        t = self.now()
        for j, r, k in rows:
            if r.status == FINISHED:  # it stopped at an EOS read a step earlier: this token is not its
                continue
            tok = toks[j]
            r.output[k] = r.tokens[len(r.prompt) + k] = tok
            if r.t_first_token is None:
                r.t_first_token = t
            if tok in self.eos or k + 1 >= r.max_new_tokens:
                del r.output[k + 1:], r.tokens[len(r.prompt) + k + 1:]
                r.t_finish = t
                self.sched.finish(r, "stop" if tok in self.eos else "length")

    def _metadata(self, sched, specs):
        m = self.model
        md = build_step_metadata(specs, block_size=self.cfg.block_size, index_topk=m.config.index_topk,
                                 device=self.device, max_logits_bytes=self.cfg.max_logits_bytes, backend=m.backend)
        # from the specs: valid before and after the step advanced num_computed
        ids = []
        for i in md.order:
            a = specs[i].num_computed
            ids += sched[i][0].tokens[a: a + specs[i].num_new]
        return md, torch.tensor(ids, dtype=torch.long, device=self.device)

    def _forward(self, ids, md):
        hidden = self.model(ids, md, self.cache)
        return self.model.logits(hidden[md.last_token_index])

    def _pick(self, logits, rows: list) -> list:
        """The next tokens of ``rows`` ``[(logits row, request)]`` (:func:`~dsa.sampling.sample_tokens`)."""
        if not rows:
            return []
        seeds = None
        if self.temperature > 0:
            seeds = torch.tensor([self._seed(r) for _, r in rows], dtype=torch.int64, device=logits.device)
        return sample_tokens(logits[[j for j, _ in rows]], seeds, self.temperature, self.cfg.top_p,
                             backend=self.model.backend).tolist()

    # ------------------------------------------------------------------ --check
    def _want_check(self, pure_decode: bool, num_tokens: int) -> bool:
        if not self.cfg.check or num_tokens > self.cfg.check_max_tokens:
            return False
        kinds = {c.kind.replace("_graph", "") for c in self.checks}
        if not pure_decode:
            return not any(k in ("prefill", "mixed") for k in kinds)
        return self._decode_steps % max(self.cfg.check_decode_every, 1) == 0

    def _check(self, sched, specs, logits, order, kind, md):
        """Re-run this step with the reference backend (rewriting the same cache slots) and compare."""
        m = self.model
        got_topk = None
        if md is not None:
            got_topk = [layer.self_attn.indexer.last_topk.clone() for layer in m.model.layers]
            m.set_record(False)
        opts = dict(indexer_dtype=m.indexer_dtype, hadamard=m.hadamard, kv_format=m.kv_format)
        saved = m.backend
        prof_on = self.profiler is not None and self.profiler.enabled
        if prof_on:
            self.profiler.enabled = False
        try:
            m.set_options(**opts, backend="reference")
            if got_topk is not None:
                m.set_record(True)
            md_ref, ids = self._metadata(sched, specs)
            ref = self._forward(ids, md_ref)
            ref_topk = [layer.self_attn.indexer.last_topk for layer in m.model.layers] if got_topk is not None else None
        finally:
            m.set_record(False)
            m.set_options(**opts, backend=saved)
            if prof_on:
                self.profiler.enabled = True
        # logits rows in the same request order
        pos_got = {i: j for j, i in enumerate(order)}
        pos_ref = {i: j for j, i in enumerate(md_ref.order)}
        idx = list(range(len(sched)))
        g = logits[[pos_got[i] for i in idx]].float()
        r = ref[[pos_ref[i] for i in idx]].float()
        diff = float((g - r).abs().max())
        same = bool(torch.equal(g.argmax(-1), r.argmax(-1)))
        frac = None
        if got_topk is not None and md is not None and md.order == md_ref.order:
            eq = [torch.equal(a.sort(-1).values, b.sort(-1).values) for A, B in zip(got_topk, ref_topk)
                  for a, b in zip(A, B)]
            frac = sum(eq) / max(len(eq), 1)
        rel = diff / max(float(r.abs().max()), 1e-30)
        self.checks.append(CheckRecord(self.sched.step_index, kind, diff, same, frac, rel))

    # ------------------------------------------------------------------ run
    def run(self, progress=None) -> list:
        """Step until every request is finished or rejected; returns all requests (added order).
        ``progress(engine, record)`` is called after each step."""
        if self.profiler is not None:
            self.profiler.__enter__()
        try:
            while self.sched.has_work():
                rec = self.step()
                if progress is not None:
                    progress(self, rec)
            self.sync()
        finally:
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
        return list(self.requests)

    def stage_seconds(self) -> dict:
        return self.profiler.totals() if self.profiler is not None else {}
