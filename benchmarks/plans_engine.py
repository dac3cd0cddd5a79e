"""Eager decode through the engine (`dsa run --cuda-graph off` on its default workload) with launch plans off and on.

For each setting: the run's decode tokens/s and step latencies, the time per stage (CUDA events), and for the planned
ops a decode step calls (``dsa._replay``) the host time of each eager call split by what the call did (replayed,
recorded, or its own path), with :func:`dsa._replay.stats` (signatures recorded, calls replayed, unfit signatures by
reason).

    python benchmarks/plans_engine.py            # both settings, default workload
    python benchmarks/plans_engine.py --decode-steps 64
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import _replay, pipeline  # noqa: E402


#: the planned ops a decode step calls, by the module the model's layers import them from at call time
OPS = [("dsa.mla", "sparse_mla"), ("dsa.mqa_logits", "fp8_paged_mqa_logits"), ("dsa.topk", "top_k_indices"),
       ("dsa.mla_cache", "concat_and_cache_mla"), ("dsa.indexer_cache", "indexer_k_quant_and_cache"),
       ("dsa.indexer_prep", "prepare_indexer_q"), ("dsa.indexer_prep", "prepare_indexer_k"),
       ("dsa.metadata", "convert_req_index_to_global_index")]


def timed_op(mod, name: str, log: dict):
    """Wrap ``mod.name`` (a planned op) so that each call's host time lands in ``log[name]`` as (kind, seconds)."""
    fn = getattr(mod, name)
    op = fn.unplanned

    def call(*args, **kwargs):
        r0, n0 = _replay._REPLAYED.get(op, 0), _replay._RECORDED.get(op, 0)
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t
        kind = ("replayed" if _replay._REPLAYED.get(op, 0) > r0 else
                "recorded" if _replay._RECORDED.get(op, 0) > n0 else "own path")
        log.setdefault(name, []).append((kind, dt))
        return out

    setattr(mod, name, call)
    return fn


def default_workload(doc: str):
    """``(device, workload)``: `dsa run`'s default GPU workload, with ``--decode-steps`` from the command line
    (``doc``: the script's docstring, whose first line describes it)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--decode-steps", type=int, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    wl = pipeline.Workload.default(dev)
    if args.decode_steps:
        wl.decode_steps = args.decode_steps
    return dev, wl


def main():
    dev, wl = default_workload(__doc__)
    rows = []
    for on in (False, True):
        _replay.clear()
        _replay.set_enabled(on)
        log, saved = {}, []
        for mod_name, name in OPS:
            mod = importlib.import_module(mod_name)
            saved.append((mod, name, timed_op(mod, name, log)))
        try:
            rep = pipeline.run(wl, dev, progress=False, cuda_graph="off")
        finally:
            for mod, name, fn in saved:
                setattr(mod, name, fn)
        print(f"== plans {'on' if on else 'off'}")
        print(pipeline.format_report(rep))
        print("replay stats:", _replay.stats())
        print("host µs per call (the stage profiler's events included):")
        for name, entries in log.items():
            kinds = {}
            for k, dt in entries:
                kinds.setdefault(k, []).append(dt)
            for k, v in sorted(kinds.items()):
                v.sort()
                print(f"  {name:<36} {k:<9} n {len(v):5d}  median {v[len(v) // 2] * 1e6:8.1f}  "
                      f"mean {sum(v) / len(v) * 1e6:8.1f}")
        d = rep.step_latency_ms["decode"]
        rows.append((on, rep.decode_tokens_per_s, d.get("p50"), d.get("p90"), rep.stage_total))
    _replay.set_enabled(None)
    print("\n| plans | decode tokens/s | step p50 ms | step p90 ms | " + " | ".join(rows[0][4]) + " (s) |")
    print("|---|---|---|---|" + "---|" * len(rows[0][4]))
    for on, tps, p50, p90, st in rows:
        print(f"| {'on' if on else 'off'} | {tps:.1f} | {p50:.2f} | {p90:.2f} | "
              + " | ".join(f"{v:.3f}" for v in st.values()) + " |")


if __name__ == "__main__":
    main()
