"""``dsa run``: a workload served by the engine (:mod:`dsa.engine`), with a report.

The built-in workload (:meth:`Workload.default`):

* on a GPU: DeepSeek-V3.2's attention (128 query heads, the 576/512 latent cache in the
  ``fp8_ds_mla`` format, the fp8 indexer with 64 heads x 128, top-k 2048, block size 64) in a
  few random-weight layers (hidden 7168, q LoRA 1536, dense MLPs so that decode can be captured
  in CUDA graphs), and several requests with 16K-64K-token prompts arriving over the first
  steps, each decoding a few hundred tokens;
* on a CPU: the same structure scaled down (16 heads, top-k 128, hidden 256, prompts of a few
  hundred to 2K tokens, 48 new tokens each, at most 4 running) so that it finishes well within a minute
  on the PyTorch references.

``--model DIR`` serves a checkpoint instead (random prompt token ids of the given lengths).
The report: TTFT per request, decode tokens/s, step latency percentiles, time per stage
(indexer logits, top-k, attention, the rest: :class:`dsa.engine.StageProfiler`), on a GPU the
eager op calls replayed from launch plans (:mod:`dsa._replay`), peak memory, and with ``check``
the largest difference of sampled steps re-run on the reference backend.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from . import _replay, backend as _backend
from .engine import STAGES, Engine, EngineConfig


@dataclass
class Workload:
    prompt_lens: list
    decode_steps: int  # new tokens per request
    arrivals: list | None = None  # engine step at which each request arrives (default: staggered)
    num_heads: int = 128
    topk: int = 2048
    layers: int = 4
    hidden: int = 7168
    q_lora_rank: int = 1536
    intermediate: int = 18432
    vocab: int = 129280
    block_size: int = 64
    kv_format: str = "fp8_ds_mla"
    indexer_dtype: str = "fp8"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 8
    max_prefill_chunk: int | None = None
    num_blocks: int | None = None  # default: every request's whole length at once, plus slack
    seed: int = 0
    temperature: float = 0.0  # 0: greedy; else sampled (dsa.sampling), each token seeded by (seed, request, k)
    top_p: float = 1.0

    @staticmethod
    def default(device: torch.device) -> "Workload":
        """DeepSeek-V3.2 attention dimensions on a GPU; a scaled-down one on the CPU."""
        if device.type == "cuda":
            return Workload(prompt_lens=[16384, 65536, 32768, 24576, 49152, 20480], decode_steps=256,
                            arrivals=[0, 0, 4, 8, 16, 24])
        return Workload(prompt_lens=[300, 77, 1030, 512, 2048, 160], decode_steps=48, arrivals=[0, 0, 3, 6, 10, 14],
                        num_heads=16, topk=128, layers=2, hidden=256, q_lora_rank=128, intermediate=512, vocab=512,
                        max_num_batched_tokens=256, max_num_seqs=4)

    def arrival_steps(self) -> list:
        if self.arrivals is not None:
            if len(self.arrivals) != len(self.prompt_lens):
                raise ValueError(f"arrivals: expected {len(self.prompt_lens)} values (one per prompt), "
                                 f"got {len(self.arrivals)}")
            return list(self.arrivals)
        return [2 * i for i in range(len(self.prompt_lens))]


def synthetic_model(wl: Workload, device, backend: str | None = None):
    """Random-weight DeepSeek-V3.2 layers with the workload's attention dimensions, built on ``device``."""
    from .model.config import ModelConfig
    from .model.layers import RotaryEmbedding
    from .model.model import DeepseekV32ForCausalLM
    from .model.tiny import INIT, TINY_CONFIG, _std

    d = dict(TINY_CONFIG)
    d.update(vocab_size=wl.vocab, hidden_size=wl.hidden, intermediate_size=wl.intermediate,
             num_hidden_layers=wl.layers, num_attention_heads=wl.num_heads, num_key_value_heads=wl.num_heads,
             q_lora_rank=wl.q_lora_rank, index_topk=wl.topk, first_k_dense_replace=wl.layers)
    cfg = ModelConfig.from_dict(d)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(wl.seed)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(cfg)
    model.to_empty(device=device)
    model.to(torch.bfloat16)
    with torch.no_grad():
        for name, t in model.named_parameters():
            mean, std = _std(name, t.shape, INIT)
            t.normal_(mean, std, generator=g)
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)
    model.set_options(indexer_dtype=wl.indexer_dtype, kv_format=wl.kv_format, backend=backend)
    return model.eval()


@dataclass
class Report:
    workload: dict
    device: str
    backend: str
    model: dict
    engine: dict
    requests: list = field(default_factory=list)
    ttft_seconds: list = field(default_factory=list)
    decode_tokens_per_s: float = 0.0
    decode_graph_tokens_per_s: float | None = None  # the CUDA-graph decode steps alone (None: no such step)
    output_tokens: int = 0
    wall_seconds: float = 0.0
    step_latency_ms: dict = field(default_factory=dict)
    stage_seconds: dict = field(default_factory=dict)  # {step kind: {stage: s}}
    stage_total: dict = field(default_factory=dict)  # {stage: s} over the profiled steps
    peak_memory_bytes: int = 0
    peak_memory_kind: str = ""
    check: dict | None = None
    warmup_seconds: float | None = None  # None: no warm-up run
    timed_compiles: int | None = None  # Triton kernel variants first launched in the timed run (None: not counted)
    plans: dict | None = None  # launch plans in the timed run (dsa._replay): replayed, recorded, refused by reason


def _plans_delta(before: dict, after: dict) -> dict:
    """What :func:`dsa._replay.stats` counted between two snapshots, summed over the ops: eager calls ``replayed``,
    signatures ``recorded``, and ``refused`` (signatures that run their op's own path every time) by reason."""
    out = {"replayed": 0, "recorded": 0, "refused": {}}
    for op, a in after.items():
        b = before.get(op, {"replayed": 0, "recorded": 0, "unfit": {}})
        out["replayed"] += a["replayed"] - b["replayed"]
        out["recorded"] += a["recorded"] - b["recorded"]
        for why, n in a["unfit"].items():
            if n > b["unfit"].get(why, 0):
                out["refused"][f"{op}: {why}"] = n - b["unfit"].get(why, 0)
    return out


def _pct(xs: list) -> dict:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] * 1e3

    return {"n": len(s), "p50": q(50), "p90": q(90), "p99": q(99), "max": s[-1] * 1e3}


class _Progress:
    """A minimal progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.n, self.enabled, self.out = max(total, 1), 0, enabled, sys.stderr
        self.t0 = time.perf_counter()

    def update(self, n: int, what: str = ""):
        self.n = n
        if not self.enabled:
            return
        w = 30
        done = min(w, int(w * self.n / self.total))
        el = time.perf_counter() - self.t0
        self.out.write(f"\r[{'#' * done}{'.' * (w - done)}] {100 * self.n / self.total:5.1f}% {what:<34} {el:7.1f}s")
        self.out.flush()

    def close(self):
        if self.enabled:
            self.out.write("\n")
            self.out.flush()


def warm_up(model, ecfg: EngineConfig, prompts: list, arrivals: list, decode_steps: int,
            device: torch.device) -> float:
    """Run the workload once through a throwaway engine, untimed: the same prompts, arrivals,
    decode steps, CUDA-graph and profiling settings as the timed run, so that the timed run
    measures the kernels, not Triton compiling them. Triton compiles one variant per
    specialisation (sizes equal to 1 or divisible by 16, 16-byte-aligned pointers, block sizes
    and split counts chosen from the shapes), and which variants a run needs depends on its batch
    compositions: warming up on the shortest and longest prompt alone left 30 variants of the
    default workload to compile inside the timed run (H200, fresh Triton cache: steps of up to
    6.6 s, 199 decode tokens/s against 1145 with every variant built). Returns its seconds."""
    t = time.perf_counter()
    eng = Engine(model, replace(ecfg, check=False))
    for p, a in zip(prompts, arrivals):
        eng.add_request(p, decode_steps, arrival_step=a)
    eng.run()
    del eng
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return time.perf_counter() - t


class _CompileCounter:
    """Counts the Triton kernel variants first launched while active (each one is compiled, or
    loaded from Triton's disk cache, at that launch). Stays 0 under the CPU interpreter."""

    def __enter__(self):
        from triton import knobs

        self.count, self._prev = 0, knobs.runtime.jit_cache_hook

        def hook(*args, **kwargs):
            self.count += 1
            return self._prev(*args, **kwargs) if self._prev is not None else False

        knobs.runtime.jit_cache_hook = hook
        return self

    def __exit__(self, *exc):
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._prev
        return False


def run(wl: Workload, device: torch.device, backend: str | None = None, *, model_dir: str | None = None,
        check: bool = False, progress: bool = True, profile: bool = True, cuda_graph: str = "auto",
        warmup: bool | None = None) -> Report:
    """Run ``wl`` through the engine and return its :class:`Report`. ``warmup`` (default: on a GPU)
    first runs :func:`warm_up` (untimed: its seconds are reported apart)."""
    device = torch.device(device)
    if model_dir is not None:
        from .model.loader import load_model

        model = load_model(model_dir, device, indexer_dtype=wl.indexer_dtype, kv_format=wl.kv_format, backend=backend)
        mc = model.config
        src = model_dir
    else:
        model = synthetic_model(wl, device, backend)
        mc = model.config
        src = "synthetic (random weights)"
    g = torch.Generator().manual_seed(wl.seed)
    prompts = [torch.randint(2, mc.vocab_size, (L,), generator=g).tolist() for L in wl.prompt_lens]
    bs = wl.block_size
    need = sum(-(-(L + wl.decode_steps) // bs) for L in wl.prompt_lens)
    num_blocks = wl.num_blocks or need + 4
    max_len = max(wl.prompt_lens, default=1) + wl.decode_steps
    ecfg = EngineConfig(block_size=bs, num_blocks=num_blocks, max_num_batched_tokens=wl.max_num_batched_tokens,
                        max_num_seqs=wl.max_num_seqs, max_prefill_chunk=wl.max_prefill_chunk,
                        max_model_len=max_len, cuda_graph=cuda_graph, profile=profile, check=check,
                        ignore_eos=True, check_max_tokens=1 << 30, greedy=wl.temperature <= 0,
                        temperature=wl.temperature, top_p=wl.top_p, seed=wl.seed)
    warm_s = None
    arrivals = list(wl.arrival_steps())
    if warmup if warmup is not None else device.type == "cuda":
        warm_s = warm_up(model, ecfg, prompts, arrivals, wl.decode_steps, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    eng = Engine(model, ecfg)
    for p, a in zip(prompts, arrivals):
        eng.add_request(p, wl.decode_steps, arrival_step=a)
    total = sum(wl.prompt_lens) + wl.decode_steps * len(wl.prompt_lens)
    bar = _Progress(total, enabled=progress)

    def on_step(e, rec):
        done = sum(r.num_computed + (1 if r.status == "finished" and r.output else 0) for r in e.requests)
        s = e.sched
        bar.update(done, f"step {s.step_index} run {len(s.running)} wait {len(s.waiting)}"
                   + (f" [{rec.kind}]" if rec is not None else ""))

    plans0 = _replay.stats()
    with _CompileCounter() as compiles:
        t0 = time.perf_counter()
        reqs = eng.run(progress=on_step)
        wall = time.perf_counter() - t0
    plans = _plans_delta(plans0, _replay.stats()) if device.type == "cuda" and _replay.enabled() else None
    bar.close()
    resolved = _backend.resolve(backend, device)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    rep = Report(
        workload=asdict(wl), device=dev_name, backend=resolved,
        model=dict(source=src, layers=mc.num_hidden_layers, heads=mc.num_attention_heads, hidden=mc.hidden_size,
                   index_topk=mc.index_topk, vocab=mc.vocab_size, indexer_dtype=model.indexer_dtype,
                   kv_format=model.kv_format),
        engine=dict(block_size=bs, num_blocks=num_blocks, max_num_batched_tokens=wl.max_num_batched_tokens,
                    max_num_seqs=wl.max_num_seqs, max_prefill_chunk=wl.max_prefill_chunk, max_model_len=max_len,
                    cuda_graph=eng.graph_mode, cuda_graph_note=eng.graph_note,
                    graph_buckets=eng.graph.buckets if eng.graph else None,
                    graph_captures=eng.graph.num_captures if eng.graph else 0,
                    graph_replays=eng.graph.num_replays if eng.graph else 0, async_steps=eng.num_async_steps,
                    steps=len(eng.steps), blocks_all_returned=eng.blocks.all_free()),
        wall_seconds=wall, warmup_seconds=warm_s,
        timed_compiles=compiles.count if device.type == "cuda" else None, plans=plans,
    )
    for r in reqs:
        rep.requests.append(dict(id=r.rid, prompt_len=len(r.prompt), arrival_step=r.arrival_step, status=r.status,
                                 error=r.error, output_len=len(r.output), ttft_s=r.ttft, finish_reason=r.finish_reason))
        if r.ttft is not None:
            rep.ttft_seconds.append(r.ttft)
    rep.output_tokens = sum(len(r.output) for r in reqs)
    dec = [s for s in eng.steps if s.kind in ("decode", "decode_graph")]
    dsec = sum(s.seconds for s in dec)
    rep.decode_tokens_per_s = sum(s.num_decodes for s in dec) / dsec if dsec > 0 else 0.0
    gdec = [s for s in dec if s.kind == "decode_graph"]
    if gdec:
        rep.decode_graph_tokens_per_s = sum(s.num_decodes for s in gdec) / max(sum(s.seconds for s in gdec), 1e-12)
    rep.step_latency_ms = {"all": _pct([s.seconds for s in eng.steps]),
                           "decode": _pct([s.seconds for s in dec]),
                           "decode_graph": _pct([s.seconds for s in eng.steps if s.kind == "decode_graph"]),
                           "prefill_or_mixed": _pct([s.seconds for s in eng.steps if s.kind in ("prefill", "mixed")])}
    rep.stage_seconds = eng.stage_seconds()
    rep.stage_total = {st: sum(k.get(st, 0.0) for k in rep.stage_seconds.values()) for st in STAGES}
    if device.type == "cuda":
        rep.peak_memory_bytes, rep.peak_memory_kind = int(torch.cuda.max_memory_allocated(device)), "GPU allocated"
    else:
        import resource

        rep.peak_memory_bytes = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        rep.peak_memory_kind = "process RSS"
    if check:
        cs = eng.checks
        rep.check = dict(
            steps=[dict(step=c.step, kind=c.kind) for c in cs], num_steps=len(cs),
            logits_max_abs_diff=max((c.logits_max_abs_diff for c in cs), default=0.0),
            logits_max_rel_diff=max((c.logits_max_rel_diff for c in cs), default=0.0),
            argmax_equal=all(c.argmax_equal for c in cs),
            topk_rows_equal_min=min((c.topk_rows_equal for c in cs if c.topk_rows_equal is not None), default=None),
            reference_backend="reference")
    return rep


def format_report(rep: Report) -> str:
    wl, m, e = rep.workload, rep.model, rep.engine
    lines = [
        f"dsa run on {rep.device} ({rep.backend} ops): {len(wl['prompt_lens'])} requests, prompts {wl['prompt_lens']}, "
        f"{wl['decode_steps']} new tokens each, "
        + ("greedy" if wl.get("temperature", 0) <= 0 else
           f"sampled (temperature {wl['temperature']:g}, top-p {wl.get('top_p', 1.0):g}, seed {wl['seed']})"),
        f"model: {m['source']}; {m['layers']} layers, {m['heads']} heads, hidden {m['hidden']}, "
        f"top-k {m['index_topk']}, "
        f"indexer {m['indexer_dtype']}, MLA cache {m['kv_format']}",
        f"engine: block {e['block_size']} x {e['num_blocks']} blocks, "
        f"budget {e['max_num_batched_tokens']} tokens/step, "
        f"<= {e['max_num_seqs']} running, {e['steps']} steps, CUDA graphs {e['cuda_graph']}"
        + (f" (buckets {e['graph_buckets']}, {e['graph_captures']} captured, {e['graph_replays']} replays, "
           f"{e['async_steps']} steps not waiting for their tokens)" if e["graph_buckets"] else "")
        + (f" [{e['cuda_graph_note']}]" if e["cuda_graph_note"] else ""),
        "warm-up: " + (f"{rep.warmup_seconds:.1f} s before the timed run (the same workload once, untimed: Triton "
                       "compiles the kernels there)" if rep.warmup_seconds is not None else "none (times include "
                       "Triton's compilation of every kernel variant)")
        + (f"; kernel variants compiled during the timed run: {rep.timed_compiles}"
           if rep.timed_compiles is not None else ""),
        "",
        f"{'request':>8} {'prompt':>8} {'arrival':>8} {'out':>5} {'TTFT ms':>10}  status",
    ]
    for r in rep.requests:
        t = f"{r['ttft_s'] * 1e3:10.1f}" if r["ttft_s"] is not None else f"{'-':>10}"
        st = r["status"] + (f": {r['error']}" if r["error"] else "")
        lines.append(f"{r['id']:>8} {r['prompt_len']:>8} {r['arrival_step']:>8} {r['output_len']:>5} {t}  {st}")
    graph_tps = rep.decode_graph_tokens_per_s
    lines += ["", f"decode: {rep.decode_tokens_per_s:,.1f} tokens/s"
              + (f" (its CUDA-graph steps alone: {graph_tps:,.1f})" if graph_tps else "")
              + f"; {rep.output_tokens} tokens out in {rep.wall_seconds:.2f} s"]
    lines.append(f"{'step latency ms':<22} {'n':>5} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}")
    for k, v in rep.step_latency_ms.items():
        if v:
            lines.append(f"{k:<22} {v['n']:>5} {v['p50']:>9.2f} {v['p90']:>9.2f} {v['p99']:>9.2f} {v['max']:>9.2f}")
    if rep.stage_seconds:
        kinds = list(rep.stage_seconds)
        lines += ["", "time per stage, seconds (eager steps; with CUDA graphs one decode step in 16 runs eagerly "
                      "to be timed)" if e["graph_buckets"] and e["cuda_graph"] == "capture" else
                  "time per stage, seconds:"]
        lines.append(f"{'stage':<16}" + "".join(f"{k:>12}" for k in kinds) + f"{'total':>12}{'share':>8}")
        tot = sum(rep.stage_total.values()) or 1.0
        for st in STAGES:
            lines.append(f"{st:<16}" + "".join(f"{rep.stage_seconds[k][st]:>12.4f}" for k in kinds)
                         + f"{rep.stage_total[st]:>12.4f}{100 * rep.stage_total[st] / tot:>7.1f}%")
    if rep.plans is not None:
        p = rep.plans
        refused = "; ".join(f"{k} ({n})" for k, n in p["refused"].items())
        lines += ["", f"launch plans (eager op calls; dsa/_replay.py): {p['replayed']:,} calls replayed, "
                      f"{p['recorded']:,} signatures recorded, "
                      + (f"refused: {refused}" if refused else "none refused")]
    if rep.peak_memory_bytes:
        lines.append(f"\npeak memory ({rep.peak_memory_kind}): {rep.peak_memory_bytes / 2**30:.2f} GiB")
    if rep.check is not None:
        c = rep.check
        lines += ["", f"check: {c['num_steps']} sampled steps re-run on the PyTorch reference backend: "
                      f"largest logit difference {c['logits_max_abs_diff']:.3g} "
                      f"({100 * c['logits_max_rel_diff']:.2f}% of the "
                      f"largest logit), greedy tokens "
                      f"{'equal' if c['argmax_equal'] else 'DIFFER'}"
                  + (f", indexer selections equal on {100 * c['topk_rows_equal_min']:.1f}% of rows (worst step)"
                     if c["topk_rows_equal_min"] is not None else "")]
    return "\n".join(lines)


__all__ = ["Workload", "Report", "run", "format_report", "synthetic_model"]
