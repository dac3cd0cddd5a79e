"""A CPU model of L2 hits for many-token sparse MLA with its index lists grouped by slot range (:mod:`dsa.mla.order`):
the prediction to make before timing a grouping variant on the H200 (``benchmarks/ab_mla_order.py``).

    python benchmarks/l2_order_sim.py [--tokens 4096] [--l2-mb 25] [--jitter 0.1] [--variants off,b4,b4s]

The model: one program per SM (132), each taking the next token when it finishes its last, walks its token's list
in tiles of 64 rows; a tile takes one time unit times ``1 + jitter * N(0, 1)``, so the programs drift apart as they
do on the GPU. Every row read goes through one LRU cache of ``--l2-mb`` of 1152-byte bf16 rows (the cache: 128K rows,
151 MB; random lists of 2048 distinct slots). Variants as in ``ab_mla_order.py``: ``off`` (as given), ``bN`` (N ranges),
``bNs`` (N ranges in serpentine order: the rows of odd waves from the top down).

Calibration (BENCHMARKS.md, forty-fourth session): Nsight Compute measured L2 hit rates of 18.9% ungrouped and 40.9%
with 4 ranges (sixteenth session, h_q 16). With jitter 0.1 the model matches the grouped rate at an effective
capacity of about 23 MB, not the H200's whole L2, and there gives 15.5% ungrouped: it under-counts the ungrouped hits.
So hit rates are read from it as differences between variants, not as levels.
It knows nothing of DRAM pages or L2 slices: 8 ranges measured slower than 4 (fifteenth session) although the model
gives them more hits.
"""
from __future__ import annotations

import argparse
import heapq
import os
import sys
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.mla.order import order_indices_ref  # noqa: E402

ROW_BYTES = 576 * 2


def random_lists(T: int, topk: int, S: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(S, generator=g)[:topk] for _ in range(T)]).to(torch.int32)


def variant(idx: torch.Tensor, S: int, name: str, sms: int) -> torch.Tensor:
    if name == "off":
        return idx
    buckets = int(name[1:].rstrip("s"))
    return order_indices_ref(idx, S, None, buckets, wave=sms if name.endswith("s") else 0)


def hit_rate(idx: torch.Tensor, l2_rows: int, sms: int = 132, tile: int = 64, jitter: float = 0.1,
             seed: int = 1) -> float:
    """The fraction of row reads that find the row in the LRU cache (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    rows = idx.tolist()
    T, n_tiles = len(rows), -(-len(rows[0]) // tile)
    lru: OrderedDict = OrderedDict()
    hits = reads = 0
    events = [(0.0, s, s, 0) for s in range(min(sms, T))]
    nxt = len(events)
    while events:
        now, sm, t, j = heapq.heappop(events)
        for r in rows[t][j * tile:(j + 1) * tile]:
            reads += 1
            if r in lru:
                hits += 1
                lru.move_to_end(r)
            else:
                lru[r] = None
                if len(lru) > l2_rows:
                    lru.popitem(last=False)
        later = now + 1.0 + jitter * torch.randn((), generator=g).item()
        if j + 1 < n_tiles:
            heapq.heappush(events, (later, sm, t, j + 1))
        elif nxt < T:
            heapq.heappush(events, (later, sm, nxt, 0))
            nxt += 1
    return hits / reads


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=131072)
    ap.add_argument("--l2-mb", type=float, default=25.0)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--variants", default="off,b2,b4,b8,b2s,b4s,b8s")
    a = ap.parse_args(argv)
    idx = random_lists(a.tokens, a.topk, a.slots)
    l2_rows = int(a.l2_mb * 2**20 / ROW_BYTES)
    print(f"# {a.tokens} tokens x {a.topk} of {a.slots} rows, {a.sms} programs, LRU {a.l2_mb} MB, jitter {a.jitter}")
    print(f"{'variant':<8} {'hit rate':>9} {'misses vs 1st':>14}")
    base = None
    for name in a.variants.split(","):
        h = hit_rate(variant(idx, a.slots, name, a.sms), l2_rows, a.sms, jitter=a.jitter)
        base = 1 - h if base is None else base
        print(f"{name:<8} {h:9.3f} {(1 - h) / base:14.3f}", flush=True)


if __name__ == "__main__":
    main()
