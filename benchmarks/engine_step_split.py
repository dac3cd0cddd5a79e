"""Where a CUDA-graph decode step of `dsa run` spends its time: host before the replay, the replay on the GPU, and
the rest (sampling, which waits for the GPU, and the engine's bookkeeping).

Runs the default workload (CUDA graphs, as `dsa run`) and, for every graph step, reads the host clock at the step's
start, around `CUDAGraph.replay()` and at the step's end, and CUDA events around the replay. The GPU sits idle for
about (step - replay on the GPU) of each step: what an engine that prepares the next step while the GPU runs this one
could win at most.

    python benchmarks/engine_step_split.py
    python benchmarks/engine_step_split.py --fill-from old_cuda_graph.py   # A/B: that file's _fill_packed
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import pipeline  # noqa: E402
from dsa.engine import cuda_graph, engine  # noqa: E402


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def measure(wl, dev, label: str) -> dict:
    """One `dsa run` of ``wl`` with the graph steps split; returns the medians (ms) and the decode tokens/s."""
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
            runs.setdefault(self._split_run, []).append((t0, cur["call"], cur["ret"], *cur["ev"], time.perf_counter()))
        return rec

    torch.cuda.CUDAGraph.replay, engine.Engine.step = timed_replay, timed_step
    try:
        rep = pipeline.run(wl, dev, progress=False)
    finally:
        torch.cuda.CUDAGraph.replay, engine.Engine.step = replay, step
    torch.cuda.synchronize()
    steps = list(runs.values())[-1]  # the timed run's engine (the warm-up's came first)
    n = len(steps)
    warm = steps[n // 8:]  # (the run's first graph steps may still fill caches)
    row = dict(label=label, tokens_s=rep.decode_tokens_per_s, graph_steps=n,
               step=_median([(s[5] - s[0]) * 1e3 for s in warm]),
               before=_median([(s[1] - s[0]) * 1e3 for s in warm]),
               launch=_median([(s[2] - s[1]) * 1e3 for s in warm]),
               gpu=_median([s[3].elapsed_time(s[4]) for s in warm]),
               after=_median([(s[5] - s[2]) * 1e3 for s in warm]))
    row["idle"] = row["step"] - row["gpu"]
    print(f"{label}: {pipeline.format_report(rep).splitlines()[0]}")
    print(f"  decode tokens/s {rep.decode_tokens_per_s:.1f}, graph step p50 {rep.step_latency_ms['decode_graph']}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fill-from", default=None,
                    help="another copy of dsa/engine/cuda_graph.py whose _fill_packed runs first (A/B)")
    ap.add_argument("--decode-steps", type=int, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    wl = pipeline.Workload.default(dev)
    if args.decode_steps:
        wl.decode_steps = args.decode_steps
    rows = []
    if args.fill_from:
        spec = importlib.util.spec_from_file_location("dsa.engine._cuda_graph_ab", args.fill_from)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        own = cuda_graph.DecodeGraphRunner._fill_packed
        cuda_graph.DecodeGraphRunner._fill_packed = other.DecodeGraphRunner._fill_packed
        try:
            rows.append(measure(wl, dev, f"_fill_packed of {os.path.basename(args.fill_from)}"))
        finally:
            cuda_graph.DecodeGraphRunner._fill_packed = own
    rows.append(measure(wl, dev, "this tree"))
    print(f"\nGPU: {torch.cuda.get_device_name(dev)}; medians over each run's graph steps (its first eighth left out), "
          "ms")
    print("| run | decode tokens/s | graph steps | step | host before replay | replay call | replay on GPU | "
          "after replay | step - GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['tokens_s']:.1f} | {r['graph_steps']} | {r['step']:.3f} | {r['before']:.3f} | "
              f"{r['launch']:.3f} | {r['gpu']:.3f} | {r['after']:.3f} | {r['idle']:.3f} |")


if __name__ == "__main__":
    main()
