"""A CPU model of L2 hits for many-token sparse MLA with its index lists grouped by slot range (:mod:`dsa.mla.order`):
the prediction to make before timing a grouping variant on the H200 (``benchmarks/ab_mla_order.py``).

    python benchmarks/l2_order_sim.py [--tokens 4096] [--l2-mb 27.5] [--jitter 0.1] [--sm-spread 0] [--miss-cost 0]
                                      [--variants off,b4,b4s,b4d]

The model: one program per SM (132), each taking the next token when it finishes its last, walks its token's list
in tiles of 64 rows; a tile takes ``rate[sm] * (1 + miss_cost * (misses / 64 - 0.7)) * (1 + jitter * N(0, 1))``
time units, so the programs drift apart as they do on the GPU: by chance (``--jitter``), by SMs that run
steadily faster or slower than others (``rate[sm] = 1 + sm_spread * N(0, 1)``), and a tile that misses more takes
longer (``--miss-cost``; 0.7 reproduces the sixteenth session's time change for its change in hits: 13.8% less
time, 1.88 to 1.62 ms, for 18.9% to 40.9% hits), which pulls a program that runs ahead of the others back to them. Every row read goes through one LRU cache of
``--l2-mb`` of 1152-byte bf16 rows (the cache: 128K rows, 151 MB; random lists of 2048 distinct slots). Variants:
``off`` (as given), ``bN`` (N ranges, as ``ab_mla_order.py``), ``bNs`` (N ranges in serpentine order: the rows of
odd waves by token index from the top down), ``bNd`` (N ranges, each program choosing its direction when it starts:
from the top down when the programs running then are, on average, in the upper half of the slots; the kernels do
not do this: the output would then depend on the schedule, not only on the inputs).

Calibration (BENCHMARKS.md, forty-fourth and forty-fifth sessions): Nsight Compute measured L2 hit rates of 18.9%
ungrouped and 40.9% with 4 ranges (sixteenth session, h_q 16). The ungrouped rate fixes the effective capacity at
about 27.5 MB (it hardly depends on the drift); the grouped rate then says how far the programs drift: 2% or 10% of
jitter alone gives 4 ranges more hits than measured, so the GPU's programs drift more than that. Hit rates are read
as differences between variants.
It knows nothing of DRAM pages or L2 slices: 8 ranges measured slower than 4 (fifteenth session) although the model
gives them more hits under every drift.
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
    buckets = int(name[1:].rstrip("sd"))
    return order_indices_ref(idx, S, None, buckets, wave=sms if name.endswith("s") else 0)


def hit_rate(idx: torch.Tensor, l2_rows: int, sms: int = 132, tile: int = 64, jitter: float = 0.1,
             seed: int = 1, sm_spread: float = 0.0, miss_cost: float = 0.0, follow: bool = False,
             slots: int = 131072) -> tuple[float, float]:
    """``(hit rate, time)``: the fraction of row reads that find the row in the LRU cache, and when the last program
    ends, in tile times (see the module docstring). ``follow``: each program walks its tiles from the last one down
    when the programs running at its start are, on average, in the upper half of the slots."""
    g = torch.Generator().manual_seed(seed)
    rows = idx.tolist()
    T, n_tiles = len(rows), -(-len(rows[0]) // tile)
    rate = [max(0.5, 1.0 + sm_spread * torch.randn((), generator=g).item()) for _ in range(sms)]
    where: list = [None] * sms  # each SM's program: the mean slot of its last tile, as a fraction of the cache
    down: dict = {}

    def begin(sm: int, t: int, now: float) -> tuple:
        running = [w for w in where if w is not None]
        down[t] = follow and bool(running) and sum(running) / len(running) > 0.5
        return (now, sm, t, 0)

    lru: OrderedDict = OrderedDict()
    hits = reads = 0
    events = [begin(s, s, 0.0) for s in range(min(sms, T))]
    heapq.heapify(events)
    nxt, end = len(events), 0.0
    while events:
        now, sm, t, j = heapq.heappop(events)
        jj = n_tiles - 1 - j if down[t] else j
        part = rows[t][jj * tile:(jj + 1) * tile]
        misses = 0
        for r in part:
            reads += 1
            if r in lru:
                hits += 1
                lru.move_to_end(r)
            else:
                misses += 1
                lru[r] = None
                if len(lru) > l2_rows:
                    lru.popitem(last=False)
        where[sm] = sum(part) / len(part) / slots
        took = (rate[sm] * (1.0 + miss_cost * (misses / len(part) - 0.7))
                * (1.0 + jitter * torch.randn((), generator=g).item()))
        later = now + max(took, 0.05)
        end = max(end, later)
        if j + 1 < n_tiles:
            heapq.heappush(events, (later, sm, t, j + 1))
        elif nxt < T:
            heapq.heappush(events, begin(sm, nxt, later))
            nxt += 1
        else:
            where[sm] = None
    return hits / reads, end


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=131072)
    ap.add_argument("--l2-mb", type=float, default=27.5)  # the ungrouped hit rate's fit (module docstring)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--sm-spread", type=float, default=0.0)
    ap.add_argument("--miss-cost", type=float, default=0.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--variants", default="off,b2,b4,b8,b2s,b4s,b8s")
    a = ap.parse_args(argv)
    idx = random_lists(a.tokens, a.topk, a.slots)
    l2_rows = int(a.l2_mb * 2**20 / ROW_BYTES)
    print(f"# {a.tokens} tokens x {a.topk} of {a.slots} rows, {a.sms} programs, LRU {a.l2_mb} MB, jitter {a.jitter}, "
          f"SM spread {a.sm_spread}, miss cost {a.miss_cost}")
    print(f"{'variant':<8} {'hit rate':>9} {'misses vs 1st':>14} {'time vs 1st':>12}")
    base = None
    for name in a.variants.split(","):
        h, end = hit_rate(variant(idx, a.slots, name, a.sms), l2_rows, a.sms, jitter=a.jitter, sm_spread=a.sm_spread,
                          miss_cost=a.miss_cost, follow=name.endswith("d"), slots=a.slots)
        base = (1 - h, end) if base is None else base
        print(f"{name:<8} {h:9.3f} {(1 - h) / base[0]:14.3f} {end / base[1]:12.3f}", flush=True)


if __name__ == "__main__":
    main()
