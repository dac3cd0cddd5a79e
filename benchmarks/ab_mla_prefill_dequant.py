"""Many-token sparse MLA over the fp8_ds_mla cache two ways, in interleaved rounds: as one call on the fp8 cache
(the kernels dequantise each gathered row in their producers), and as the whole cache dequantised to a bf16 copy
first (:func:`dsa.dequantize_fp8_ds_mla`, one pass over the cache) followed by the call on that copy, which
takes the bf16 kernels (at 64 heads and more the ping-pong schedule; at 16/32 the one-producer fill). The
dequantised values are those the kernels' producers compute (fp8 x group scale in fp32, rounded to bf16), so both
ways attend over the same bf16 rows. The fp8 way is forced (``sparse_mla`` itself takes the copy where
:func:`dsa.mla.kernel.dequant_first_pays`); the call as dispatched is timed beside them and must be bitwise equal
to the way it chose. Prints each way's time and the two ways' largest differences. GPU.

    python benchmarks/ab_mla_prefill_dequant.py [ROUNDS] [H_Q ...] [--tokens 4096] [--context 131072]
        [--min-ratio BLOCK_H:RATIO ...]

``--min-ratio`` overrides :data:`dsa.mla.kernel.DEQUANT_FIRST_MIN_RATIO` for the dispatched call.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dsa.mla.kernel as mla_kernel  # noqa: E402
from dsa import _replay, dequantize_fp8_ds_mla, sparse_mla  # noqa: E402
from dsa.bench import interleaved_us, mla_counts, mla_inputs  # noqa: E402

TOPK = 2048


def main():
    _replay.set_enabled(False)  # (each call decides afresh: this script switches the dispatch between calls)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rounds", type=int, nargs="?", default=3)
    ap.add_argument("heads", type=int, nargs="*", default=[16, 32, 64, 128])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--min-ratio", nargs="+", default=[], metavar="BLOCK_H:RATIO")
    a = ap.parse_args()
    for kv_ in a.min_ratio:
        block_h, ratio = map(int, kv_.split(":"))
        mla_kernel.DEQUANT_FIRST_MIN_RATIO[block_h] = ratio
    T, S_KV, rounds, heads = a.tokens, a.context, a.rounds, a.heads or [16, 32, 64, 128]
    sm = 192 ** -0.5
    rows = []
    for h in heads:
        q, kv, idx = mla_inputs(T, h, TOPK, 1, S_KV, "fp8_ds_mla")
        kv16 = torch.empty(*kv.shape[:-1], 576, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
        fns = {"fp8 cache": lambda: forced_way(None, lambda: sparse_mla(q, kv, idx, sm, out=out, backend="triton")),
               "dequantise + bf16": lambda: (dequantize_fp8_ds_mla(kv, out=kv16),
                                             sparse_mla(q, kv16, idx, sm, out=out, backend="triton"))[1],
               "dequantise alone": lambda: dequantize_fp8_ds_mla(kv, out=kv16),
               "dispatched": lambda: sparse_mla(q, kv, idx, sm, out=out, backend="triton")}
        chosen = "dequantise + bf16" if mla_kernel.dequant_first_pays(T, h, TOPK, S_KV) else "fp8 cache"
        same, diff, nan = compare(fns, out, chosen, "fp8 cache", "dequantise + bf16")
        times = interleaved_us(fns, rounds, graph=False, return_mode="median")
        rows.append((h, diff, nan, times, chosen, same))
        print(h, diff, nan, chosen, same, {n: [round(t, 1) for t in v] for n, v in times.items()}, flush=True)
        q = kv = kv16 = idx = out = None
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}; {T} tokens, topk {TOPK} of {S_KV}; do_bench medians of {rounds} "
          "interleaved rounds, µs; TFLOP/s of the whole way")
    print(f"{'h_q':>4}  {'fp8 cache':>18}  {'dequantise + bf16':>26}  {'dequantise alone':>16}  {'dispatched':>10}"
          "  max |diff| out/ml/lse")
    for h, diff, nan, t, chosen, same in rows:
        med = {n: sorted(v)[len(v) // 2] for n, v in t.items()}
        flops = mla_counts(T, h, TOPK, "fp8_ds_mla")[0]
        a, b = med["fp8 cache"], med["dequantise + bf16"]
        print(f"{h:>4}  {a:9.1f} {flops / a / 1e6:6.1f} TF  {b:9.1f} {flops / b / 1e6:6.1f} TF"
              f" {(b / a - 1) * 100:+6.1f}%  {med['dequantise alone']:16.1f}  {med['dispatched']:10.1f}"
              f"  {'/'.join(f'{d:.2g}' for d in diff)}  dispatched = {'copy' if chosen != 'fp8 cache' else 'fp8'}"
              f"{' (bitwise)' if same else ' NOT EQUAL!'}{'  NaN!' if nan else ''}")


def compare(fns, out, chosen, a, b):
    """Run ways ``a``, ``b`` and ``"dispatched"`` of ``fns`` once each into ``out`` (poisoned with NaN first):
    whether the dispatched results are bitwise those of the way ``chosen``, the largest differences of ``a`` and
    ``b`` (out, max_logits, lse), and whether any result holds NaN."""
    res = {}
    for n in (a, b, "dispatched"):
        out.fill_(float("nan"))
        r = fns[n]()
        torch.cuda.synchronize()
        res[n] = (out.clone(), r[1].clone(), r[2].clone())
    same = all(torch.equal(x, y) for x, y in zip(res["dispatched"], res[chosen]))
    diff = [(x.float() - y.float()).abs().max().item() for x, y in zip(res[a], res[b])]
    return same, diff, any(torch.isnan(x).any().item() for v in res.values() for x in v)


def forced_way(way, call):
    """``call()`` with :func:`dsa.mla.kernel._dequant_first` saying ``way`` (``None``: the fp8 kernels dequantise the
    gathered rows; ``"pages"``: a copy of the pages read is tried)."""
    keep = mla_kernel._dequant_first
    mla_kernel._dequant_first = lambda q, kv, indices: way
    try:
        return call()
    finally:
        mla_kernel._dequant_first = keep


if __name__ == "__main__":
    main()
