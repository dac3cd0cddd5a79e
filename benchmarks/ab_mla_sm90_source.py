"""The Hopper sparse-MLA module of this tree (``dsa.mla.kernel_sm90``) against another source of it, in interleaved
rounds, over the issue-4 shapes and the 64/128-head ones: each case's times, whether both give bitwise the same
``(out, max_logits, lse)``, and (decode rows, a third of them with their last 100 entries -1) the largest errors
against the PyTorch reference. H100 / H200.

    git show REV:dsa/mla/kernel_sm90.py > old_sm90.py      # (on a machine with the history)
    python benchmarks/ab_mla_sm90_source.py old_sm90.py [ROUNDS] [CASE ...]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from whatif_bulk import import_source  # noqa: E402
from whatif_sm90 import call_with  # noqa: E402

from dsa import _replay  # noqa: E402
from dsa.bench import interleaved_us, mla_counts, mla_inputs, mla_run_checked  # noqa: E402
from dsa.mla import kernel_sm90, sparse_mla_ref  # noqa: E402

# (name, T, h_q, topk, num_req, s_kv, format); decode rows: one token per request
CASES = [("prefill_bf16_h32", 4096, 32, 2048, 1, 131072, "bf16"),
         ("prefill_bf16_h16", 4096, 16, 2048, 1, 131072, "bf16")]
CASES += [(f"fp8_h16_b{b}", b, 16, 2048, b, 32768, "fp8_ds_mla") for b in (32, 64)]
CASES += [(f"fp8_h32_b{b}", b, 32, 2048, b, 32768, "fp8_ds_mla") for b in (32, 64, 128)]
CASES += [(f"bf16_h{h}_b32", 32, h, 2048, 32, 32768, "bf16") for h in (16, 32)]
CASES += [("fp8_h128_b64", 64, 128, 2048, 64, 32768, "fp8_ds_mla"), ("bf16_h128_b64", 64, 128, 2048, 64, 32768, "bf16")]
CASES += [(f"prefill_bf16_h{h}", 4096, h, 2048, 1, 131072, "bf16") for h in (64, 128)]


def main():
    if len(sys.argv) < 2 or not os.path.isfile(sys.argv[1]):
        sys.exit(__doc__)
    mods = {"old": import_source(open(sys.argv[1]).read(), "_kernel_sm90_other"), "new": kernel_sm90}
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    names = sys.argv[3:]
    _replay.set_enabled(False)  # (each call decides afresh: the module is switched between calls)
    sm = 192 ** -0.5
    rows = []
    for name, T, h, topk, nreq, s_kv, fmt in CASES:
        if names and name not in names:
            continue
        prefill = name.startswith("prefill")
        q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, block_size=64)
        if not prefill:  # -1 entries in a third of the rows
            idx[::3, -100:] = -1
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")

        def call(v):
            return call_with(mods[v], q, flat, idx, sm, out=out)

        want = None if prefill else sparse_mla_ref(q, flat, idx, sm)
        res, errs = {}, {}
        for v in mods:
            res[v], errs[v] = mla_run_checked(lambda v=v: call(v), out, want)
        same = all(torch.equal(res["old"][k], res["new"][k]) for k in range(3))
        t = interleaved_us({v: (lambda v=v: call(v)) for v in mods}, rounds, not prefill)
        med = {v: sorted(x)[len(x) // 2] for v, x in t.items()}
        flops, _ = mla_counts(T, h, topk, fmt)
        rows.append((name, med["old"], med["new"], flops / med["new"] / 1e6, same))
        print(name, {v: [round(x, 1) for x in xs] for v, xs in t.items()}, "bitwise same" if same else "DIFFER",
              "errors out / lse / max_logits (new):", errs["new"], flush=True)
        q = kv = idx = flat = out = want = res = None
        torch.cuda.empty_cache()
    print(f"\n{'case':<20}{'old µs':>10}{'new µs':>10}{'new/old':>9}{'new TF/s':>10}  same")
    for name, o, n, tf, same in rows:
        print(f"{name:<20}{o:10.1f}{n:10.1f}{n / o:9.3f}{tf:10.1f}  {same}")


if __name__ == "__main__":
    main()
