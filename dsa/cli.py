"""The ``dsa`` command line.

    dsa run   [--device D] [--backend B] [--prompt-lens 300,77] [--decode-steps N] [--check] [--json]
    dsa info
    dsa generate / dsa make-tiny-model   (the model; see ``dsa generate -h``)
"""
from __future__ import annotations

import argparse
import json
import sys


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("dsa: --device cuda requested but no CUDA GPU is available")
    return dev


def cmd_run(args) -> int:
    from dataclasses import replace

    from . import pipeline

    dev = _device(args.device)
    wl = pipeline.Workload.default(dev)
    over = {k: v for k, v in dict(prompt_lens=args.prompt_lens, decode_steps=args.decode_steps, num_heads=args.heads,
                                  topk=args.topk, block_size=args.block_size, kv_format=args.kv_format,
                                  next_n=args.next_n, seed=args.seed).items() if v is not None}
    wl = replace(wl, **over)
    rep = pipeline.run(wl, dev, backend=args.backend, check=args.check, progress=not args.json)
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(rep), indent=1))
    else:
        print(pipeline.format_report(rep))
    return 0


def cmd_info(args) -> int:
    import torch
    import triton

    from . import backend

    print(f"dsa {__import__('dsa').__version__}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"auto backend: {backend.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsa", description="DeepSeek Sparse Attention in portable Triton")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run the DSA pipeline on a built-in workload and print a per-stage report")
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    r.add_argument("--backend", default=None, choices=["auto", "triton", "reference"],
                   help="implementation of every op (default: $DSA_BACKEND or auto)")
    r.add_argument("--prompt-lens", type=_ints, default=None, help="comma-separated prompt lengths")
    r.add_argument("--decode-steps", type=int, default=None)
    r.add_argument("--heads", type=int, default=None, help="query heads h_q (multiple of 8, <= 128)")
    r.add_argument("--topk", type=int, default=None)
    r.add_argument("--block-size", type=int, default=None)
    r.add_argument("--kv-format", default=None, choices=["bf16", "fp8_ds_mla"])
    r.add_argument("--next-n", type=int, default=None, help="tokens per request per decode step (MTP)")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--check", action="store_true", help="compare sampled steps with the PyTorch reference backend")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(fn=cmd_run)

    i = sub.add_parser("info", help="versions and which backend 'auto' picks here")
    i.set_defaults(fn=cmd_info)

    try:
        from .model.cli import add_subcommands
    except ImportError:
        add_subcommands = None
    if add_subcommands is not None:
        add_subcommands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
