"""The ``dsa`` command line.

    dsa run   [--device D] [--backend B] [--model DIR] [--prompt-lens 300,77] [--decode-steps N] [--check] [--json]
    dsa bench [--kernels indexer,topk,mla] [--quick] [--plot FILE.png] [--json]
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
    from dataclasses import asdict, replace

    from . import pipeline

    dev = _device(args.device)
    wl = pipeline.Workload.default(dev)
    over = {k: v for k, v in dict(
        prompt_lens=args.prompt_lens, decode_steps=args.decode_steps, arrivals=args.arrivals, num_heads=args.heads,
        topk=args.topk, layers=args.layers, hidden=args.hidden, vocab=args.vocab, block_size=args.block_size,
        kv_format=args.kv_format, indexer_dtype=args.indexer_dtype, max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_seqs, max_prefill_chunk=args.chunk, num_blocks=args.num_blocks,
        seed=args.seed, temperature=args.temperature, top_p=args.top_p).items() if v is not None}
    wl = replace(wl, **over)
    if args.arrivals is None and args.prompt_lens is not None:
        wl = replace(wl, arrivals=None)  # staggered default for the given prompts
    if wl.max_num_batched_tokens < wl.max_num_seqs:
        wl = replace(wl, max_num_seqs=wl.max_num_batched_tokens)
    graph = {"auto": "auto", "on": "capture", "off": "off"}[args.cuda_graph]
    try:
        rep = pipeline.run(wl, dev, backend=args.backend, model_dir=args.model, check=args.check,
                           progress=not args.json and not args.no_progress, profile=not args.no_stages,
                           cuda_graph=graph, warmup={"auto": None, "on": True, "off": False}[args.warmup])
    except (ValueError, FileNotFoundError) as e:
        print(f"dsa run: {e}", file=sys.stderr)
        return 2
    if args.json:
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
    print(f"Hopper kernels (Gluon): {_hopper_kernels()}")
    print(f"fp8 e4m3fn in the portable kernels: {_fp8_path()}")
    print(f"sparse MLA launch configurations: {_mla_configs()}")
    return 0


def _mla_configs() -> str:
    """Whose launch configurations the portable sparse-MLA kernel takes here (:data:`dsa.mla.kernel.TARGET_CONFIGS`)."""
    import torch

    from .backend import gpu_target

    target = gpu_target(torch.device("cuda")) if torch.cuda.is_available() else None
    if target is None:
        return "the H200's (no GPU in use)"
    from .mla.kernel import TARGET_CONFIGS

    name = f"{target[0]} {target[1]}"
    return f"this GPU's ({name})" if target in TARGET_CONFIGS else f"the H200's ({name})"


def _fp8_path() -> str:
    """How the portable kernels handle e4m3fn here (:func:`dsa.backend.fp8_native`)."""
    import torch

    from .backend import FP8_EMULATION_ENV, fp8_emulation_forced, fp8_native

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if fp8_native(dev):
        return "native (Triton's e4m3fn type)"
    if fp8_emulation_forced():
        return f"software conversions ({FP8_EMULATION_ENV} is set)"
    return "software conversions (Triton has no e4m3fn type on this GPU)"


def _hopper_kernels() -> str:
    """Whether the sm_90 Gluon kernels (sparse_mla, fp8_paged_mqa_logits) serve calls on this machine."""
    import torch
    import triton

    from .backend import on_hopper

    try:
        from .mla import kernel_sm90  # noqa: F401
        from .mqa_logits import kernel_sm90 as _  # noqa: F401
    except ImportError as e:  # a Triton without Gluon
        return f"unavailable ({e})"
    from .backend import GLUON_TRITON, gluon_enabled, gluon_validated

    if not gluon_enabled():
        if gluon_validated():
            return "off (DSA_GLUON=0): the portable Triton kernels run"
        return (f"off: they are validated with Triton {GLUON_TRITON}x only (this is {triton.__version__}; "
                f"DSA_GLUON=1 takes them anyway): the portable Triton kernels run")
    if not torch.cuda.is_available() or not on_hopper(torch.device("cuda")):
        return "not used here (no NVIDIA Hopper GPU, or the CPU interpreter: the portable Triton kernels run)"
    return "used for sparse_mla (64-head groups; 16/32-head groups) and fp8_paged_mqa_logits"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsa", description="DeepSeek Sparse Attention in portable Triton")
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="serve a workload through the DSA engine (continuous batching, chunked prefill, "
                                   "CUDA-graph decode) and print a report")
    r.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    r.add_argument("--backend", default=None, choices=["auto", "triton", "reference"],
                   help="implementation of every op (default: $DSA_BACKEND or auto)")
    r.add_argument("--model", default=None, help="serve this checkpoint (config.json + *.safetensors) instead of "
                                                 "random-weight layers")
    r.add_argument("--prompt-lens", type=_ints, default=None, help="comma-separated prompt lengths (one per request)")
    r.add_argument("--arrivals", type=_ints, default=None, help="comma-separated arrival step of each request")
    r.add_argument("--decode-steps", type=int, default=None, help="new tokens per request")
    r.add_argument("--heads", type=int, default=None, help="query heads h_q (multiple of 8, <= 128; synthetic model)")
    r.add_argument("--topk", type=int, default=None, help="indexer top-k (synthetic model)")
    r.add_argument("--layers", type=int, default=None, help="layers (synthetic model)")
    r.add_argument("--hidden", type=int, default=None, help="hidden size (synthetic model)")
    r.add_argument("--vocab", type=int, default=None, help="vocabulary size (synthetic model)")
    r.add_argument("--block-size", type=int, default=None, help="tokens per cache block")
    r.add_argument("--num-blocks", type=int, default=None, help="cache blocks (default: all requests at once)")
    r.add_argument("--kv-format", default=None, choices=["bf16", "fp8_ds_mla"])
    r.add_argument("--indexer-dtype", default=None, choices=["fp8", "bf16"])
    r.add_argument("--max-batched-tokens", type=int, default=None, help="token budget of one step")
    r.add_argument("--max-seqs", type=int, default=None, help="running requests at most")
    r.add_argument("--chunk", type=int, default=None, help="largest prefill chunk of one request")
    r.add_argument("--cuda-graph", default="auto", choices=["auto", "on", "off"], help="decode steps as CUDA graphs")
    r.add_argument("--no-stages", action="store_true", help="no per-stage timing")
    r.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                   help="run the workload once first, untimed, so that Triton compiles there (auto: on a GPU)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--seed", type=int, default=None, help="weights, prompts and sampling")
    r.add_argument("--temperature", type=float, default=None, help="sample the new tokens (default 0: greedy)")
    r.add_argument("--top-p", type=float, default=None, help="nucleus of the sampled tokens (default 1)")
    r.add_argument("--check", action="store_true", help="re-run sampled steps on the PyTorch reference backend")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(fn=cmd_run)

    from .bench import add_subcommand as add_bench

    add_bench(sub)

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
