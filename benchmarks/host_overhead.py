"""Host time of eager ``sparse_mla`` calls, and of one kernel launch broken into its parts.

Each call is timed with launch plans off (``dsa._replay``: every call decides and launches through Triton's JIT)
and on (the first call with a signature recorded, the rest replayed). The host time is measured with the GPU kept
busy (a queue of large matmuls ahead of the calls), so the host never waits for it: ``perf_counter`` around N calls,
divided by N. The launch parts (plans off) are timed on the arguments captured from a real call: Triton's whole
``kernel[grid](...)``, its argument binder alone, the current device and stream, and the compiled kernel's launcher
called directly.

    python benchmarks/host_overhead.py            # the table
    python benchmarks/host_overhead.py --profile  # plus a cProfile of each case (top entries by own time)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import _replay, sparse_mla  # noqa: E402
from dsa.bench import mla_inputs  # noqa: E402

CASES = [  # (label, format, h_q, batch)
    ("decode fp8 h16 b64", "fp8_ds_mla", 16, 64),
    ("decode fp8 h32 b64", "fp8_ds_mla", 32, 64),
    ("decode bf16 h16 b32", "bf16", 16, 32),
    ("decode fp8 h128 b1", "fp8_ds_mla", 128, 1),
]


def busy(ms: float = 120.0):
    """Queue about ``ms`` of matmuls on the current stream, so the host's next calls never wait for the GPU."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-4) * 1e3
    for _ in range(int(ms / one) + 1):
        a @ a
    return a


def host_us(fn, n: int = 200) -> float:
    """Host µs per call of ``fn`` with the GPU busy (median of 5 rounds; ``n`` calls of at most 2 launches each stay
    inside the driver's queue of pending launches, past which a launch waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        busy()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


class Capture:
    """Stands in for a JIT kernel: records each launch's grid and arguments, and the compiled kernel it returns."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            ck = self.fn[grid](*args, **kwargs)
            self.calls.append((grid, args, kwargs, ck))
            return ck
        return go


def launch_parts(jit, grid, args, kwargs, ck, n: int = 300) -> dict:
    """µs per call of each part of one launch (the GPU busy; ``n`` launches stay well inside the driver's queue of
    pending launches, past which a launch waits for the GPU)."""
    from triton import knobs
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    binder = jit.device_caches[device][4]
    names = [p.name for p in jit.params]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    full = tuple(bound[k] for k in names)
    g = tuple(grid) + (1,) * (3 - len(grid))
    run, fn_, meta = ck.run, ck.function, ck.packed_metadata
    parts = {
        "JIT launch": lambda: jit[grid](*args, **kwargs),
        "binder": lambda: binder(*args, **kwargs),
        "device+stream": lambda: driver.active.get_current_stream(driver.active.get_current_device()),
        "4 knobs": lambda: (knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                            knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook),
        "direct run": lambda: run(g[0], g[1], g[2], stream, fn_, meta, None, None, None, *full),
    }
    return {name: host_us(f, n) for name, f in parts.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import dsa.mla.kernel as K
    import dsa.mla.kernel_bulk as KB
    import dsa.mla.kernel_sm90 as K90

    t_op = torch.zeros(16, device="cuda")
    print(f"trivial torch op (x.add_(1)): {host_us(lambda: t_op.add_(1)):.1f} us; torch.empty(64 KB): "
          f"{host_us(lambda: torch.empty(16384, device='cuda')):.1f} us")
    rows = []
    for label, fmt, h, B in CASES:
        q, kv, idx = mla_inputs(B, h, 2048, B, 32768, fmt, dev="cuda")[:3]
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(B, h, 512, dtype=torch.bfloat16, device="cuda")
        sm = 576 ** -0.5

        def call():
            return sparse_mla(q, flat, idx, sm, out=out)
        from triton.testing import do_bench

        _replay.set_enabled(False)
        us = host_us(call)
        us50 = host_us(call, 50)
        bench_off = do_bench(call, return_mode="median") * 1e3
        _replay.set_enabled(None)
        us_on = host_us(call)
        bench_on = do_bench(call, return_mode="median") * 1e3
        planned = _replay.lookup(next(k for k, _ in reversed(list(_replay._PLANS)))) is not None
        _replay.set_enabled(False)
        caps = {m: Capture(getattr(mod, m)) for mod, m in ((K90, "_sparse_mla_sm90_kernel"),
                                                             (K, "_sparse_mla_combine_kernel"),
                                                             (K, "_sparse_mla_fwd_kernel"),
                                                             (KB, "_sparse_mla_bulk_kernel"))}
        mods = {"_sparse_mla_sm90_kernel": K90, "_sparse_mla_combine_kernel": K, "_sparse_mla_fwd_kernel": K,
                "_sparse_mla_bulk_kernel": KB}
        for m, c in caps.items():
            setattr(mods[m], m, c)
        try:
            call()  # (plans off: through the JIT)
        finally:
            for m, c in caps.items():
                setattr(mods[m], m, c.fn)
        launches = [(m, c.fn) + c.calls[0][:4] for m, c in caps.items() if c.calls]
        print(f"\n{label}: host {us:.1f} us per call ({us50:.1f} over 50 calls), with plans {us_on:.1f} "
              f"(replayed: {planned}); do_bench eager {bench_off:.1f} -> {bench_on:.1f} us; launches: "
              f"{', '.join(m for m, *_ in launches)}")
        for m, jit, grid, a, kw, ck in launches:
            parts = launch_parts(jit, grid, a, kw, ck)
            print(f"  {m}: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
            rows.append((label, m, us, us_on, bench_off, bench_on, parts))
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(200):
                call()
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            print("\n".join(s.getvalue().splitlines()[:40]))
    print("\n| case | host µs, plans off | on | do_bench eager µs, off | on | kernel | JIT launch | binder | "
          "device+stream | 4 knobs | direct run |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, m, us, us_on, b_off, b_on, p in rows:
        print(f"| {label} | {us:.1f} | {us_on:.1f} | {b_off:.1f} | {b_on:.1f} | {m} | {p['JIT launch']:.1f} | "
              f"{p['binder']:.1f} | {p['device+stream']:.1f} | {p['4 knobs']:.1f} | {p['direct run']:.1f} |")


if __name__ == "__main__":
    main()
