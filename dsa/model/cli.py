"""``dsa generate`` and ``dsa make-tiny-model`` (wired into :mod:`dsa.cli` via :func:`add_subcommands`).

    dsa generate --model DIR --prompt-token-ids 1,2,3 [--prompt-token-ids 4,5 ...] --max-new-tokens N
                 [--greedy] [--temperature T] [--top-p P] [--seed S] [--json] [--device D] [--backend B]
                 [--indexer-dtype fp8|bf16] [--hadamard|--no-hadamard] [--kv-format bf16|fp8_ds_mla]
                 [--block-size 64] [--ignore-eos]
    dsa make-tiny-model DIR [--seed S] [--layers N] [--index-topk K]
"""
from __future__ import annotations

import argparse
import json


def _ids(s: str) -> list:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {s!r}")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return out


def cmd_generate(args) -> int:
    import torch

    from .generate import generate
    from .loader import load_model

    dev = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(args.model, dev, indexer_dtype=args.indexer_dtype, hadamard=args.hadamard,
                       kv_format=args.kv_format, backend=args.backend)
    outs = generate(model, args.prompt_token_ids, args.max_new_tokens, greedy=args.greedy,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                    block_size=args.block_size)
    if args.json:
        print(json.dumps({"outputs": outs}))
    else:
        for p, o in zip(args.prompt_token_ids, outs):
            print(f"prompt ({len(p)} tokens): {','.join(map(str, p))}")
            print(f"output ({len(o)} tokens): {','.join(map(str, o))}")
    return 0


def cmd_make_tiny_model(args) -> int:
    from .tiny import make_tiny_model

    over = {}
    if args.layers is not None:
        over["num_hidden_layers"] = args.layers
    if args.index_topk is not None:
        over["index_topk"] = args.index_topk
    make_tiny_model(args.dir, seed=args.seed, **over)
    print(f"wrote a tiny random DeepSeek-V3.2 checkpoint to {args.dir}")
    return 0


def add_subcommands(sub) -> None:
    g = sub.add_parser("generate", help="continue token-id prompts with a DeepSeek-V3.2 checkpoint (attention on dsa)")
    g.add_argument("--model", required=True, help="local directory with config.json and *.safetensors")
    g.add_argument("--prompt-token-ids", type=_ids, action="append", required=True,
                   help="comma-separated token ids of one prompt (repeat for a batch)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--greedy", action="store_true", help="argmax decoding (default: sampling)")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at the config's eos_token_id")
    g.add_argument("--json", action="store_true", help='print {"outputs": [[ids...], ...]}')
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--backend", default=None, choices=["auto", "triton", "reference"],
                   help="implementation of every op (default: $DSA_BACKEND or auto)")
    g.add_argument("--indexer-dtype", default="fp8", choices=["fp8", "bf16"],
                   help="fp8 (the real model's arithmetic) or bf16 (exact, for checking)")
    g.add_argument("--hadamard", default=None, action=argparse.BooleanOptionalAction,
                   help="Hadamard rotation of indexer q and k (default: on for fp8, off for bf16)")
    g.add_argument("--kv-format", default="bf16", choices=["bf16", "fp8_ds_mla"], help="MLA cache format")
    g.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    g.set_defaults(fn=cmd_generate)

    t = sub.add_parser("make-tiny-model", help="write a small random DeepSeek-V3.2 checkpoint (HF format)")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--layers", type=int, default=None, help="number of layers (default 3)")
    t.add_argument("--index-topk", type=int, default=None, help="indexer top-k (default 16)")
    t.set_defaults(fn=cmd_make_tiny_model)
