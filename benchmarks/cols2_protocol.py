"""The hand-offs of ``kernel_sm90``'s ``COLS2`` form (two math warpgroups splitting the output columns of a 16/32-head
group) as a model, run in random interleavings under mbarrier semantics, on the CPU.

Each partition is its program order of mbarrier waits and arrivals and of the reads and writes of the shared slots
they guard, as :func:`dsa.mla.kernel_sm90._producer`, ``_math_rows`` (``COLS2``) and ``_math_cols_hi`` do them:

* the producer (or two, on alternate tiles): wait ``empty[s]``, write tile buffer ``s``, arrive ``full[s]``;
* the lead: wait ``full[s]``; QK reads the buffer; wait ``pfree[s]``; write P slot ``s`` and the factor slot ``s``;
  arrive ``pready[s]``; P.V reads P and the buffer; arrive ``empty[s]``; at the end write the final sums, arrive ``fin``;
* the second: wait ``full[s]`` and ``pready[s]``; read the factor; P.V reads P and the buffer; arrive ``pfree[s]`` and
  ``empty[s]`` (which counts two arrivals); at the end wait ``fin``, read the sums.

A barrier completes a phase when its count of arrivals is in; ``wait(parity)`` passes once the phase of that parity
has completed (a fresh barrier passes a wait on parity 1, the producers' first waits). Every read must see the
content the reader expects (its tile's), no write may land while a read of the old content is open, and the program
must not deadlock. :func:`check` runs a protocol (or a mutant of it, :data:`MUTANTS`) over many interleavings.

    python benchmarks/cols2_protocol.py [ROUNDS]          (CPU)
"""
from __future__ import annotations

import random
import sys

#: each mutant breaks one rule of the real protocol; :func:`check` must find every one
MUTANTS = {
    "hi_no_pready": "the second warpgroup does not wait for P",
    "hi_early_empty": "the second releases the buffer before its P.V has read it",
    "lead_early_pready": "the lead signals P ready before it writes the factor",
    "hi_no_fin": "the second reads the final sums without waiting for them",
    "empty_count_1": "the buffer is released by one arrival (the lead's) instead of two",
}
#: changes that break nothing: the lead's wait for ``pfree[s]`` is implied by its wait for ``full[s]`` two tiles later
#: (the producer refills buffer ``s`` only once both warpgroups have released it, and the second releases the P slot
#: at the same point), so without it no interleaving goes wrong. The kernel keeps the wait (one already-passed wait a
#: tile): the P slot's hand-off then does not rest on the buffer's.
HARMLESS = {"lead_no_pfree": "the lead does not wait for the P slot's release"}


class Barrier:
    def __init__(self, count: int):
        self.count, self.arrived, self.phases = count, 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.phases = 0, self.phases + 1

    def passes(self, parity: int) -> bool:
        return (self.phases & 1) != parity


def _producer(n, par, step):
    for i in range(par, n, step):
        s = i % 2
        yield ("wait", f"empty{s}", ((i // 2) & 1) ^ 1)
        yield ("write", f"buf{s}", i)
        yield ("arrive", f"full{s}")


def _lead(n, m):
    for i in range(n):
        s = i % 2
        yield ("wait", f"full{s}", (i // 2) & 1)
        yield ("read", f"buf{s}", i)  # QK (the read stays open to the P.V)
        if m != "lead_no_pfree":
            yield ("wait", f"pfree{s}", ((i // 2) & 1) ^ 1)
        yield ("write", f"p{s}", i)
        if m == "lead_early_pready":
            yield ("arrive", f"pready{s}")
        yield ("write", f"a{s}", i)
        if m != "lead_early_pready":
            yield ("arrive", f"pready{s}")
        yield ("read", f"p{s}", i)  # P.V over columns 0-255
        yield ("done", f"p{s}")
        yield ("done", f"buf{s}")
        yield ("arrive", f"empty{s}")
    yield ("write", "fin", 0)
    yield ("arrive", "xfin")


def _hi(n, m):
    for i in range(n):
        s = i % 2
        yield ("wait", f"full{s}", (i // 2) & 1)
        if m != "hi_no_pready":
            yield ("wait", f"pready{s}", (i // 2) & 1)
        yield ("read", f"a{s}", i)
        yield ("done", f"a{s}")
        yield ("read", f"p{s}", i)  # P.V over columns 256-511
        yield ("read", f"buf{s}", i)
        if m == "hi_early_empty":
            yield ("arrive", f"empty{s}")
        yield ("done", f"buf{s}")
        yield ("done", f"p{s}")
        yield ("arrive", f"pfree{s}")
        if m != "hi_early_empty" and m != "empty_count_1":
            yield ("arrive", f"empty{s}")
    if m != "hi_no_fin":
        yield ("wait", "xfin", 0)
    yield ("read", "fin", 0)
    yield ("done", "fin")


def run(n: int, m: str | None, rng: random.Random, alt: bool) -> str | None:
    """One random interleaving of ``n`` tiles under mutant ``m`` (None: the real protocol); returns the first
    violation found (a string) or None."""
    bars = {f"{k}{s}": Barrier(2 if k == "empty" and m != "empty_count_1" else 1)
            for k in ("full", "empty", "pready", "pfree") for s in (0, 1)}
    bars["xfin"] = Barrier(1)
    content = {}  # slot -> the tile whose content it holds
    readers = {}  # (partition, slot) -> the tile it is reading
    producers = [_producer(n, 0, 2), _producer(n, 1, 2)] if alt else [_producer(n, 0, 1)]
    parts = {f"producer{j}": p for j, p in enumerate(producers)}
    parts.update(lead=_lead(n, m), hi=_hi(n, m))
    nxt = {name: next(g, None) for name, g in parts.items()}
    while any(a is not None for a in nxt.values()):
        ready = [name for name, a in nxt.items() if a is not None and (a[0] != "wait" or bars[a[1]].passes(a[2]))]
        if not ready:
            return "deadlock: " + ", ".join(f"{k} at {a}" for k, a in nxt.items() if a is not None)
        name = rng.choice(ready)
        act = nxt[name]
        if act[0] == "arrive":
            bars[act[1]].arrive()
        elif act[0] == "write":
            open_reads = [k for k in readers if k[1] == act[1]]
            if open_reads:
                return f"{name} writes {act[1]} (tile {act[2]}) while {open_reads[0][0]} reads tile {readers[open_reads[0]]}"
            content[act[1]] = act[2]
        elif act[0] == "read":
            if content.get(act[1]) != act[2]:
                return f"{name} reads {act[1]} expecting tile {act[2]}, holds {content.get(act[1])}"
            readers[(name, act[1])] = act[2]
        elif act[0] == "done":
            del readers[(name, act[1])]
        nxt[name] = next(parts[name], None)
    return None


def check(m: str | None = None, tiles=range(0, 9), rounds: int = 200, seed: int = 0):
    """The first violation in ``rounds`` interleavings of each tile count and producer form, or None."""
    rng = random.Random(seed)
    for n in tiles:
        for alt in (False, True):
            for _ in range(rounds):
                bad = run(n, m, rng, alt)
                if bad:
                    return f"{n} tiles{', alternate producers' if alt else ''}: {bad}"
    return None


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 400
    print("COLS2 protocol:", check(None, rounds=rounds) or "no violation")
    for m, what in MUTANTS.items():
        print(f"mutant {m} ({what}):", check(m, rounds=rounds) or "NOT CAUGHT")
    for m, what in HARMLESS.items():
        print(f"harmless {m} ({what}):", check(m, rounds=rounds) or "no violation")


if __name__ == "__main__":
    main()
