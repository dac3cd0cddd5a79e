"""A/B of decode-logits launch configurations (``fp8_paged_mqa_logits``), interleaved on one machine.

Each case (block size x next_n x block-table order) builds the decode benchmark's inputs (B = 64 requests of
32K-128K keys; ``--quick``: 16 requests of 8K-32K), runs every configuration once and checks its logits bitwise
against the first one's, then times them in ``--rounds`` interleaved rounds (``dsa.bench.decode_ms``: the smaller of
the eager and the CUDA-graph median). The table says whether each configuration's logits equal the first one's bit
for bit, and gives the median round, GB/s over the keys' 132 bytes, and every round. No PyTorch baseline: this
compares our own variants (``dsa bench`` has the baselines).

A configuration is ``default`` (the dispatcher's choice) or a Python dict literal passed as ``config=`` to
:func:`dsa.mqa_logits.kernel.fp8_paged_mqa_logits_triton`: ``{'gluon': {...}}`` for the Hopper kernel's options
(``SPAN``, ``STAGES``, ``WGS``, ``MAXNREG``; :func:`dsa.mqa_logits.kernel_sm90.default_config` fills the rest),
``{'gluon': False, ...}`` for the Triton kernel's.

    python benchmarks/ab_paged_configs.py --bs 1 --next-n 1 default "{'gluon': {'MAXNREG': 64}}"
    python benchmarks/ab_paged_configs.py --bs 4 --next-n 2 default "{'gluon': {'MAXNREG': 128}}" \\
        "{'gluon': {'STAGES': 2}}"
    TRITON_INTERPRET=1 python benchmarks/ab_paged_configs.py --cpu-smoke default "{'gluon': False, 'SPAN': 128}"
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa.bench import decode_ms, indexer_decode_inputs  # noqa: E402
from dsa.constants import INDEXER_ROW_BYTES  # noqa: E402
from dsa.layouts import indexer_cache_blocks  # noqa: E402
from dsa.mqa_logits.kernel import fp8_paged_mqa_logits_triton  # noqa: E402


def parse_config(text: str):
    """``default`` -> None, else a dict literal (``{'gluon': {...}}`` or ``{'gluon': False, ...}``)."""
    if text == "default":
        return None
    cfg = ast.literal_eval(text)
    if not isinstance(cfg, dict):
        raise SystemExit(f"a configuration is 'default' or a dict literal, got {text!r}")
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="'default' or dict literals; the first is the reference")
    ap.add_argument("--bs", default="1", help="block sizes, comma-separated")
    ap.add_argument("--next-n", default="1,2", help="next_n values, comma-separated")
    ap.add_argument("--order", default="shuffled,in-order", help="block tables: shuffled, in-order or both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 requests of 8K-32K keys")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    args = ap.parse_args()
    configs = [(c, parse_config(c)) for c in args.configs]
    if args.cpu_smoke:
        dev, (B, lo, hi), rep, warmup = "cpu", (2, 100, 300), 1, 0
    else:
        assert torch.cuda.is_available(), "needs a GPU (or --cpu-smoke with TRITON_INTERPRET=1)"
        dev, (B, lo, hi), rep, warmup = "cuda", ((16, 8192, 32768) if args.quick else (64, 32768, 131072)), 60, 15
        print(f"# {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for bs in (int(x) for x in args.bs.split(",")):
        for nn in (int(x) for x in args.next_n.split(",")):
            for order in args.order.split(","):
                if order not in ("shuffled", "in-order"):
                    raise SystemExit(f"--order: shuffled or in-order, got {order!r}")
                g = torch.Generator(device=dev).manual_seed(1)
                q, cache, w, ctx, bt, max_len = indexer_decode_inputs(B, lo, hi, bs, nn, g, dev,
                                                                      in_order=order == "in-order")
                blocks = indexer_cache_blocks(cache)
                nbytes = float(ctx.sum()) * INDEXER_ROW_BYTES
                outs, equal = [], []
                for name, cfg in configs:
                    out = torch.full((B * nn, max_len), float("nan"), device=dev)
                    fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True, out, config=cfg)
                    equal.append("yes" if not outs or torch.equal(out, outs[0]) else "**no**")
                    outs.append(out)
                times = [[] for _ in configs]
                for _ in range(args.rounds):
                    for k, ((name, cfg), out) in enumerate(zip(configs, outs)):
                        fn = lambda cfg=cfg, out=out: fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True,
                                                                                  out, config=cfg)
                        times[k].append(decode_ms(fn, dev, name, log=lambda s: None, rep=rep, warmup=warmup))
                for (name, _), ts, eq in zip(configs, times, equal):
                    ms = sorted(ts)[len(ts) // 2]
                    row = (f"| block {bs}, next_n {nn}, {order} | {name} | {eq} | {ms * 1e3:.1f} | "
                           f"{nbytes / ms / 1e6:.0f} | " + " / ".join(f"{t * 1e3:.1f}" for t in ts) + " |")
                    rows.append(row)
                    print(row, flush=True)
                del q, cache, blocks, outs
                if dev == "cuda":
                    torch.cuda.empty_cache()
    print("\n| case | configuration | logits bitwise equal to the first's | µs (median round) | GB/s | rounds (µs) |"
          "\n|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
