"""Where a CUDA-graph decode step of `dsa run` spends its time: host before the replay, the replay on the GPU, and
the GPU's gap between one graph step's replay and the next's.

Runs the default workload (CUDA graphs, as `dsa run`) and, for every graph step, reads the host clock at the step's
start, around `CUDAGraph.replay()` and at the step's end, and CUDA events around the replay. The gap from one graph
step's end event to the next one's start event is GPU time spent on neither replay: idle while the host prepares
the step, or the small copies between the replays. Each run once with the engine's default (graph steps do not
wait for their tokens, ``async_decode``) and once with every step waiting for its tokens, greedy (as `dsa run`) and
sampled (temperature 0.8, top-p 0.95: the graphs draw the tokens themselves).

    python benchmarks/engine_step_split.py
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import pipeline  # noqa: E402
from dsa.engine import engine  # noqa: E402
from plans_engine import default_workload  # noqa: E402  (benchmarks/, the script's own folder)


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def measure(wl, dev, label: str, waiting: bool = False) -> dict:
    """One `dsa run` of ``wl`` with the graph steps split (``waiting``: each step waits for its tokens); returns the
    medians (ms) and the decode tokens/s."""
    runs = {}  # engine -> its graph steps (t_start, t_replay_call, t_replay_return, start event, end event, t_end)
    cur, engines = {}, itertools.count()
    replay, step = torch.cuda.CUDAGraph.replay, engine.Engine.step

    def timed_replay(self):
        cur["call"] = time.perf_counter()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        replay(self)
        e1.record()
        cur["ret"], cur["ev"] = time.perf_counter(), (e0, e1)

    def timed_step(self):
        cur.clear()
        t0 = time.perf_counter()
        rec = step(self)
        if rec is not None and rec.kind == "decode_graph" and "ev" in cur:
            if not hasattr(self, "_split_run"):
                self._split_run = next(engines)  # (not id(): the timed run's engine may reuse the warm-up's)
            runs.setdefault(self._split_run, []).append((t0, cur["call"], cur["ret"], *cur["ev"], time.perf_counter(),
                                                         rec.index))
        return rec

    # the eager decode steps (the stage profiler's samples): host time in each of the engine's parts, GPU time of the
    # forward (events around it)
    parts, eager = {}, {}
    saved = {name: getattr(engine.Engine, name) for name in ("sync", "_metadata", "_forward", "_pick")}

    def timed_part(name, fn):
        def call(self, *a, **k):
            t = time.perf_counter()
            if name == "_forward":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                out = fn(self, *a, **k)
                e1.record()
                parts["gpu"] = (e0, e1)
            else:
                out = fn(self, *a, **k)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            return out
        return call

    def timed_eager_step(self):
        parts.clear()
        t0 = time.perf_counter()
        rec = timed_step(self)
        if rec is not None and rec.kind == "decode" and "gpu" in parts:
            row = {k: v * 1e3 for k, v in parts.items() if k != "gpu"}
            row["step"], row["ev"] = (time.perf_counter() - t0) * 1e3, parts["gpu"]
            eager.setdefault(self._split_run if hasattr(self, "_split_run") else -1, []).append(row)
        return rec

    async_ok = engine.Engine._async_ok
    torch.cuda.CUDAGraph.replay, engine.Engine.step = timed_replay, timed_eager_step
    for name, fn in saved.items():
        setattr(engine.Engine, name, timed_part(name, fn))
    if waiting:
        engine.Engine._async_ok = lambda self, check: False
    try:
        rep = pipeline.run(wl, dev, progress=False)
    finally:
        torch.cuda.CUDAGraph.replay, engine.Engine.step, engine.Engine._async_ok = replay, step, async_ok
        for name, fn in saved.items():
            setattr(engine.Engine, name, fn)
    torch.cuda.synchronize()
    ev = list(eager.values())[-1] if eager else []
    if ev:
        med = {k: _median([r.get(k, 0.0) for r in ev]) for k in ("step", "sync", "_metadata", "_forward", "_pick")}
        med["gpu"] = _median([r["ev"][0].elapsed_time(r["ev"][1]) for r in ev])
        print(f"  eager decode steps ({len(ev)}), medians ms: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
              + " (gpu: the forward's events; the others host time in the engine's methods)")
    steps = list(runs.values())[-1]  # the timed run's engine (the warm-up's came first)
    n = len(steps)
    warm = steps[n // 8:]  # (the run's first graph steps may still fill caches)
    row = dict(label=label, tokens_s=rep.decode_tokens_per_s, graph_steps=n,
               step=_median([(s[5] - s[0]) * 1e3 for s in warm]),
               before=_median([(s[1] - s[0]) * 1e3 for s in warm]),
               launch=_median([(s[2] - s[1]) * 1e3 for s in warm]),
               gpu=_median([s[3].elapsed_time(s[4]) for s in warm]),
               after=_median([(s[5] - s[2]) * 1e3 for s in warm]),
               gap=_median([a[4].elapsed_time(b[3]) for a, b in zip(warm, warm[1:]) if b[6] == a[6] + 1]))
    print(f"{label}: {pipeline.format_report(rep).splitlines()[0]}")
    print(f"  decode tokens/s {rep.decode_tokens_per_s:.1f}, graph step p50 {rep.step_latency_ms['decode_graph']}")
    return row


def sampler_cost(dev, vocab: int) -> None:
    """The token choice alone, CUDA-graph medians (µs) over ``[B, vocab]`` fp32 logits (``randn * 3``, seeded by B:
    whether a row's first candidate is rejected, which costs the top-p kernel its later passes, depends on them;
    T 0.8): the
    greedy argmax (torch) against :func:`~dsa.sampling.sample_tokens` sampled, the Triton kernel and the PyTorch
    reference, with and without the top-p nucleus (0.95); whether the two picked the same tokens; the kernel's
    logits read once per row over the time (GB/s, % of 4.3 TB/s: its floor is one pass over the logits); and the
    reference's nucleus alone, from one 1-D sort of the batch (:func:`~dsa.sampling.nucleus`) against a row-by-row
    ``[B, V]`` sort (:func:`~dsa.sampling.nucleus_ref`)."""
    import triton

    from dsa.sampling import nucleus, nucleus_ref, row_seed, sample_tokens, scaled_logits

    print(f"\ntoken choice alone over [B, {vocab}] fp32 logits (CUDA-graph medians, µs; T 0.8; kernel = Triton, "
          "ref = PyTorch)")
    print("| B | argmax | kernel, top-p 1 | ref, top-p 1 | kernel, top-p 0.95 | ref, top-p 0.95 | same tokens | "
          "kernel top-p 1: GB/s (% of 4.3 TB/s) | ref nucleus: 1-D sort | [B, V] sort |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B in (1, 8, 16, 64):
        lg = torch.randn(B, vocab, device=dev, generator=torch.Generator(dev).manual_seed(B)) * 3
        z = scaled_logits(lg, 0.8)
        seeds = torch.tensor([row_seed(0, i, 5) for i in range(B)], device=dev)
        same = all(torch.equal(sample_tokens(lg, seeds, 0.8, tp, backend="triton"),
                               sample_tokens(lg, seeds, 0.8, tp, backend="reference")) for tp in (1.0, 0.95))
        t = [triton.testing.do_bench_cudagraph(fn) * 1e3 for fn in (
            lambda: torch.argmax(lg, -1),
            lambda: sample_tokens(lg, seeds, 0.8, 1.0, backend="triton"),
            lambda: sample_tokens(lg, seeds, 0.8, 1.0, backend="reference"),
            lambda: sample_tokens(lg, seeds, 0.8, 0.95, backend="triton"),
            lambda: sample_tokens(lg, seeds, 0.8, 0.95, backend="reference"),
            lambda: nucleus(z, 0.95), lambda: nucleus_ref(z, 0.95))]
        gbs = B * vocab * 4 / t[1] * 1e-3
        print(f"| {B} | " + " | ".join(f"{x:.1f}" for x in t[:5]) + f" | {same} | {gbs:.0f} ({gbs / 43:.1f}%) | "
              + " | ".join(f"{x:.1f}" for x in t[5:]) + " |")


def main():
    dev, wl = default_workload(__doc__)
    sampler_cost(dev, wl.vocab)
    sampled = dataclasses.replace(wl, temperature=0.8, top_p=0.95)
    rows = [measure(wl, dev, "each step waits for its tokens", True), measure(wl, dev, "default (async_decode)"),
            measure(sampled, dev, "sampled (T 0.8, top-p 0.95), waiting", True),
            measure(sampled, dev, "sampled, default (async_decode)")]
    print(f"\nGPU: {torch.cuda.get_device_name(dev)}; medians over each run's graph steps (its first eighth left out), "
          "ms")
    print("| run | decode tokens/s | graph steps | step | host before replay | replay call | replay on GPU | "
          "after replay | GPU gap to the next replay |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['tokens_s']:.1f} | {r['graph_steps']} | {r['step']:.3f} | {r['before']:.3f} | "
              f"{r['launch']:.3f} | {r['gpu']:.3f} | {r['after']:.3f} | {r['gap']:.3f} |")


if __name__ == "__main__":
    main()
