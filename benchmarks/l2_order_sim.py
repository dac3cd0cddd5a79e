"""A CPU model of the L2 for many-token sparse MLA with its index lists grouped by slot range (:mod:`dsa.mla.order`):
the prediction to make before timing a grouping variant on the H200 (``benchmarks/ab_mla_order.py``).

    python benchmarks/l2_order_sim.py [--tokens 4096] [--l2-mb 60] [--partitions 2] [--jitter 0.1] [--sm-spread 0]
                                      [--miss-cost 0] [--variants off,b4,b4s,b4d]

The L2: ``--partitions`` partitions of ``--l2-mb / partitions`` each, LRU over 1152-byte bf16 rows. SM ``s`` is
attached to partition ``s % partitions``; every row has a home partition (a fixed random hash). A row read looks in
the SM's own partition first (one L2 lookup); on a miss, a row homed there comes from DRAM, and a row homed in the
other partition costs a second lookup there (a crossing of the fabric between the partitions), which finds it or
fetches it from DRAM. Either way the own partition keeps a copy, so a row read by SMs of both partitions is held
twice. One partition is a plain LRU shared by every SM.

The programs: one per SM (132), each taking the next token when it finishes its last, walks its token's list in
tiles of 64 rows; a tile takes ``rate[sm] * (1 + miss_cost * (misses / 64 - 0.7)) * (1 + jitter * N(0, 1))`` time
units (misses: rows from DRAM), so the programs drift apart as on the GPU: by chance (``--jitter``), by SMs that run
steadily faster or slower (``rate[sm] = 1 + sm_spread * N(0, 1)``), and by tiles that miss more (``--miss-cost``;
0.5 with SMs 3% apart gives 4 ranges 13.2% less time than the lists as given, where the sixteenth session measured
13.8%, 1.88 to 1.62 ms). The cache: 128K
rows, 151 MB; random lists of 2048 distinct slots. Variants: ``off`` (as given), ``bN`` (N ranges, as
``ab_mla_order.py``), ``bNs`` (N ranges in serpentine order: the rows of odd waves by token index from the top
down), ``bNd`` (N ranges, each program choosing its direction when it starts: from the top down when the programs
running then are, on average, in the upper half of the slots; the kernels do not do this: the output would then
depend on the schedule, not only on the inputs).

Per variant it prints the fraction of row reads served by L2 (``served``: 1 - DRAM reads / row reads), L2 lookups
per row read (``lookups``: L2 bytes / row bytes, ignoring the DRAM fills), their hit rate (``hit``: what ncu calls
the L2 hit rate, a far hit after a near miss counting one miss and one hit) and the modelled time.

Calibration (BENCHMARKS.md, forty-sixth session). Two partitions of 30 MB (60 MB, the GH100 die's whole L2, which
the H200 is taken to have; ``profile_order.py`` prints the device's own figure) with the default jitter give, for the
sixteenth session's two profiles of h_q 16 prefill (4096 tokens), no parameter fitted:

    | lists     | served: model / measured | lookups: model / measured | hit: model / measured |
    | as given  | 0.270 / 0.262            | 1.426 / 1.440             | 0.189 / 0.189         |
    | 4 ranges  | 0.532 / 0.532            | 1.332 / 1.334             | 0.400 / 0.409         |

(measured: DRAM reads 7.21 / 4.57 GB and L2 bytes 14.07 / 13.03 GB of 9.77 GB requested; ncu's hit rate). The same
session then measured 8 ranges and serpentine order over 4 and 8, and the crossings themselves (ncu's
``lts__t_sectors_srcunit_ltcfabric`` over the SMs' sectors): the model, aligned, had every order's share served within
0.013 and its crossings within 0.009 (the driver gives 60 MB of L2). One LRU
cannot fit all three: the forty-fourth and forty-fifth sessions fitted it to ncu's hit rate alone (27.5 MB and
drift), which took every lookup for a row read and read the hit rate as the share of rows not read from DRAM.
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


def simulate(idx: torch.Tensor, l2_rows: int, sms: int = 132, tile: int = 64, jitter: float = 0.1, seed: int = 1,
             sm_spread: float = 0.0, miss_cost: float = 0.0, follow: bool = False, slots: int = 131072,
             partitions: int = 2) -> dict:
    """The model of the module docstring over the index lists ``idx`` and an L2 of ``l2_rows`` rows in all.
    Returns ``served`` (row reads not from DRAM), ``lookups`` (L2 lookups per row read), ``hit`` (lookup hit rate)
    and ``time`` (when the last program ends, in tile times). ``follow``: each program walks its tiles from the
    last one down when the programs running at its start are, on average, in the upper half of the slots."""
    g = torch.Generator().manual_seed(seed)
    rows = idx.tolist()
    T, n_tiles = len(rows), -(-len(rows[0]) // tile)
    rate = [max(0.5, 1.0 + sm_spread * torch.randn((), generator=g).item()) for _ in range(sms)]
    home = torch.randint(0, partitions, (slots,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    cap = max(1, l2_rows // partitions)
    caches = [OrderedDict() for _ in range(partitions)]
    where: list = [None] * sms  # each SM's program: the mean slot of its last tile, as a fraction of the cache
    down: dict = {}

    def begin(sm: int, t: int, now: float) -> tuple:
        running = [w for w in where if w is not None]
        down[t] = follow and bool(running) and sum(running) / len(running) > 0.5
        return (now, sm, t, 0)

    def keep(cache: OrderedDict, r: int) -> None:
        cache[r] = None
        if len(cache) > cap:
            cache.popitem(last=False)

    reads = lookups = hits = dram = 0
    events = [begin(s, s, 0.0) for s in range(min(sms, T))]
    heapq.heapify(events)
    nxt, end = len(events), 0.0
    while events:
        now, sm, t, j = heapq.heappop(events)
        jj = n_tiles - 1 - j if down[t] else j
        part = rows[t][jj * tile:(jj + 1) * tile]
        own = caches[sm % partitions]
        misses = 0
        for r in part:
            reads += 1
            lookups += 1
            if r in own:
                hits += 1
                own.move_to_end(r)
                continue
            far = caches[home[r]]
            if far is not own:
                lookups += 1
                if r in far:
                    hits += 1
                    far.move_to_end(r)
                    keep(own, r)
                    continue
                keep(far, r)
            dram += 1
            misses += 1
            keep(own, r)
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
    return dict(served=1 - dram / reads, lookups=lookups / reads, hit=hits / lookups, time=end)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=131072)
    ap.add_argument("--l2-mb", type=float, default=60.0)  # in all, split evenly between the partitions
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--sm-spread", type=float, default=0.0)
    ap.add_argument("--miss-cost", type=float, default=0.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--variants", default="off,b2,b4,b8,b2s,b4s,b8s")
    a = ap.parse_args(argv)
    idx = random_lists(a.tokens, a.topk, a.slots)
    l2_rows = int(a.l2_mb * 2**20 / ROW_BYTES)
    print(f"# {a.tokens} tokens x {a.topk} of {a.slots} rows, {a.sms} programs, L2 {a.l2_mb} MB in {a.partitions} "
          f"partitions, jitter {a.jitter}, SM spread {a.sm_spread}, miss cost {a.miss_cost}")
    print(f"{'variant':<8} {'served':>7} {'lookups':>8} {'hit':>6} {'DRAM reads vs 1st':>18} {'lookups vs 1st':>15} "
          f"{'time vs 1st':>12}")
    base = None
    for name in a.variants.split(","):
        r = simulate(variant(idx, a.slots, name, a.sms), l2_rows, a.sms, jitter=a.jitter, sm_spread=a.sm_spread,
                     miss_cost=a.miss_cost, follow=name.endswith("d"), slots=a.slots, partitions=a.partitions)
        base = r if base is None else base
        print(f"{name:<8} {r['served']:7.3f} {r['lookups']:8.3f} {r['hit']:6.3f} "
              f"{(1 - r['served']) / (1 - base['served']):18.3f} {r['lookups'] / base['lookups']:15.3f} "
              f"{r['time'] / base['time']:12.3f}", flush=True)

if __name__ == "__main__":
    main()
