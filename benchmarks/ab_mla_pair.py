"""The pair schedule of the Hopper kernel's 16/32-head groups (``config pair=True``: two math warpgroups on
alternate tiles, each with its own producer warpgroup and 256 of the output columns, so that one's softmax runs
while the other's products do; ``pair="pv"``: with the other warpgroup's P.V issued before each QK, not behind it)
against the one-math-warpgroup schedule (``pair=False``), in interleaved rounds;
for fp8 also the pair schedule with all four raw groups loaded early (``PAIR_EARLY4``);
beside them the default call (``sparse_mla`` as it picks: for 16-head fp8 decode from batch 32 that is
:mod:`dsa.mla.kernel_bulk`) and the PyTorch baseline (``dsa.bench.mla_baseline``). Decode rows: s_q 1, topk 2048 of
32K per request, CUDA-graph medians; prefill rows: 4096 tokens, topk 2048 of 128K, ``do_bench`` medians. Reports
each variant's largest |out - reference| and lse error on the decode rows (the PyTorch reference), the largest
difference between the one-warpgroup schedule and the pair schedule in either order, and the times (µs); the table is
printed last. H200.

    python benchmarks/ab_mla_pair.py [ROUNDS] [--cases fp8_h32,bf16_h16,...] [--splits 1,2,4]
    python benchmarks/ab_mla_pair.py --trace     # where each partition's clocks go per tile, both orders

``--trace``: the pair schedule with its clock trace (``config trace=``, ``TRACE`` in ``kernel_sm90``) at a few decode
shapes, both orders: per partition and phase the SM clocks per own tile (each program's mean over its threads, the
median over the programs), beside the call's time with and without the trace.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import mla_baseline, mla_baseline_chunk, mla_counts, mla_inputs, mla_run_checked  # noqa: E402
from dsa.mla import sparse_mla, sparse_mla_ref  # noqa: E402
from dsa.mla.kernel import SM90_ROWS_SMALL_HEADS, sparse_mla_triton  # noqa: E402

SM_SCALE = 192 ** -0.5
#: group -> [(name, T, h_q, num_req, s_kv, format)]
GROUPS = {
    f"{fmt}_h{h}": [(f"{fmt} h{h} b{b}", b, h, b, 32768, "fp8_ds_mla" if fmt == "fp8" else "bf16")
                    for b in (1, 32, 64, 128)]
    for fmt in ("fp8", "bf16") for h in (16, 32)
}
GROUPS["prefill"] = [(f"prefill bf16 h{h}", 4096, h, 1, 131072, "bf16") for h in (16, 32)]
#: the pair schedule's fp8 producers with all four raw groups loaded before their buffer is free (sm_90a compile:
#: 4 spill stores and 15 reloads per tile in each producer, 5-8 reloads in the math warpgroups)
PAIR_EARLY4 = dict(regs=104, early=4, math_regs=152)
GROUPS["prefill_fp8"] = [(f"prefill fp8 h{h}", 4096, h, 1, 131072, "fp8_ds_mla") for h in (16, 32)]


def compile_only(fmt: str, h_q: int, splits: int, cluster: bool = False, extra: bool = False,
                 pair: bool | str = True, trace: bool = False):
    """CPU: compile the Hopper kernel for one 16/32-head call (``fmt`` "bf16" or "fp8_ds_mla", 3 tokens, topk
    2048, ``splits`` splits, merged in clusters or not, ``extra``: with topk_length and a sink, ``pair``: the config
    value, True / False / "pv", ``trace``: with the clock trace) for sm_90a through a
    stand-in driver (nothing launches; the device facts :mod:`dsa.backend` asks for are faked); returns the compiled
    kernel. Run without ``TRITON_INTERPRET``, in a process of its own (the driver and ``JITFunction.run`` stay
    replaced)."""
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    import dsa.backend
    from dsa.mla import kernel_sm90

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from compile_targets import _Driver

    driver.set_active(_Driver(GPUTarget("cuda", 90, 32)))
    got = {}
    run = jit.JITFunction.run

    def warmup_only(self, *a, grid, warmup, **kw):
        got[self.fn.__name__] = k = run(self, *a, grid=grid, warmup=True, **kw)
        return k

    jit.JITFunction.run = warmup_only
    kernel_sm90._prefer_l1 = lambda k: None
    kernel_sm90.max_active_clusters = lambda n, d=0: 1 << 10
    torch.cuda.current_device = lambda: 0
    dsa.backend.on_hopper = lambda dev: True
    T, S = 3, 4096
    q = torch.randn(T, h_q, 576).to(torch.bfloat16)
    kv = (torch.zeros(S, 656, dtype=torch.uint8) if fmt == "fp8_ds_mla" else torch.zeros(S, 576, dtype=torch.bfloat16))
    kw = dict(attn_sink=torch.zeros(h_q), topk_length=torch.full((T, ), 2048, dtype=torch.int32)) if extra else {}
    tr = dict(trace=torch.zeros(T * 16 * 4096, dtype=torch.int32)) if trace else {}
    try:  # (the call fails after the compile: the stand-in driver launches nothing)
        sparse_mla_triton(q, kv, torch.zeros(T, 2048, dtype=torch.int32), SM_SCALE, num_splits=splits,
                          config=dict(SM90_ROWS_SMALL_HEADS, block_h=16 if h_q <= 16 else 32, cluster=cluster,
                                      pair=pair, **tr), **kw)
    except Exception:
        if "_sparse_mla_sm90_kernel" not in got:
            raise
    return got["_sparse_mla_sm90_kernel"]


#: the math warpgroups' and the producers' trace slots (``kernel_sm90._math_pair``, ``kernel_sm90._producer``)
MATH_PHASES = ("other", "full", "products", "softmax", "own P.V", "loop")
PRODUCER_PHASES = ("wait", "fill", "loop")


def trace_pair(cases=(("fp8_ds_mla", 32, 64), ("fp8_ds_mla", 32, 128), ("bf16", 32, 64), ("fp8_ds_mla", 16, 64))):
    """H200: the pair schedule's clock trace at decode shapes ``(format, h_q, batch)`` (s_q 1, topk 2048 of 32K), both
    orders. Prints one row per case and order, clocks per own tile."""
    rows = []
    for fmt, h_q, b in cases:
        q, kv, idx = mla_inputs(b, h_q, 2048, b, 32768, fmt)
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(b, h_q, 512, dtype=torch.bfloat16, device="cuda")
        trace = torch.zeros(b * 16 * 4096, dtype=torch.int32, device="cuda")
        want = sparse_mla_ref(q, kv, idx, SM_SCALE)
        for pair in (True, "pv"):
            def call(tr=None):
                cfg = dict(SM90_ROWS_SMALL_HEADS, block_h=16 if h_q <= 16 else 32, pair=pair)
                if tr is not None:
                    cfg["trace"] = tr
                return lambda: sparse_mla_triton(q, flat, idx, SM_SCALE, out=out, config=cfg)

            res, err = mla_run_checked(call(trace), out, want)  # the traced call is checked too
            trace.zero_()
            call(trace)()
            torch.cuda.synchronize()
            t = trace.view(-1, 4, 8, 128).double().mean(-1)  # [programs, partition, slot]
            t = t[t[:, 0, 6] > 0]  # programs whose first math warpgroup owned a tile
            per = lambda part, k, n: (t[:, part, k] / t[:, part, n].clamp(min=1)).median().item()  # noqa: E731
            wg = [[per(w, k, 6) for k in (0, 1, 2, 3, 4, 5)] for w in (0, 1)]
            pr = [[per(2 + w, k, 3) for k in (0, 1, 2)] for w in (0, 1)]
            us = do_bench_cudagraph(call(), rep=100, return_mode="median") * 1e3
            us_tr = do_bench_cudagraph(call(trace), rep=100, return_mode="median") * 1e3
            rows.append((f"{'fp8' if fmt != 'bf16' else 'bf16'} h{h_q} b{b}", "pv" if pair == "pv" else "qk", us, us_tr,
                         wg, pr, err))
            print(rows[-1], flush=True)
        q = kv = flat = idx = out = want = trace = None
        torch.cuda.empty_cache()
    print(f"\nclocks per own tile (median over programs); math warpgroups 0 / 1: {', '.join(MATH_PHASES)}; "
          f"producers 0 / 1: {', '.join(PRODUCER_PHASES)}")
    print(f"{'case':<14}{'order':<6}{'µs':>7}{'traced':>8}  {'math WG0':<36}{'math WG1':<36}{'producer 0':<18}"
          f"{'producer 1':<18}{'err out/lse':<12}")
    for name, order, us, us_tr, wg, pr, err in rows:
        f = lambda v: "/".join(f"{x:.0f}" for x in v)  # noqa: E731
        print(f"{name:<14}{order:<6}{us:7.1f}{us_tr:8.1f}  {f(wg[0]):<36}{f(wg[1]):<36}{f(pr[0]):<18}{f(pr[1]):<18}"
              f"{err[0]:.1g}/{err[1]:.1g}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    ap.add_argument("--cases", default="fp8_h32,fp8_h16,bf16_h32,bf16_h16,prefill")
    ap.add_argument("--splits", default="", help="also the pair schedule at these forced split counts (decode rows "
                    "from batch 32), e.g. 1,2,4: whether it wants fewer splits than the default picks")
    ap.add_argument("--trace", action="store_true", help="the pair schedule's clock trace instead (trace_pair)")
    args = ap.parse_args()
    if args.trace:
        return trace_pair()
    forced = [int(x) for x in args.splits.split(",") if x]
    rows = []
    for group in args.cases.split(","):
        for name, T, h_q, nreq, s_kv, fmt in GROUPS[group]:
            q, kv, idx = mla_inputs(T, h_q, 2048, nreq, s_kv, fmt)
            flat = kv.reshape(-1, kv.shape[-1])
            out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device="cuda")
            bh = 16 if h_q <= 16 else 32

            def call(num_splits=None, **cfg):
                return lambda: sparse_mla_triton(q, flat, idx, SM_SCALE, out=out, num_splits=num_splits,
                                                 config=dict(SM90_ROWS_SMALL_HEADS, block_h=bh, **cfg))

            calls = {"rows": call(pair=False), "pair": call(pair=True), "pair pv": call(pair="pv")}
            if fmt == "fp8_ds_mla":  # all four raw groups loaded before the buffer is free (a few spills)
                calls["pair e4"] = call(pair=True, producer=PAIR_EARLY4)
            calls["default"] = lambda: sparse_mla(q, kv, idx, SM_SCALE, out=out)
            prefill = name.startswith("prefill")
            if not prefill and T >= 32:
                for ns in forced:
                    calls[f"pair /{ns}"] = call(ns, pair=True)
            want = None if prefill else sparse_mla_ref(q, kv, idx, SM_SCALE)
            res, errs = {}, {}
            for n, fn in calls.items():
                res[n], err = mla_run_checked(fn, out, want)
                if err is not None:
                    errs[n] = err[:2]
            d = max((res["rows"][k].float() - res[n][k].float()).abs().max().item() for k in range(3)
                    for n in ("pair", "pair pv"))
            times = {n: [] for n in calls}
            for _ in range(args.rounds):
                for n, fn in calls.items():
                    if prefill:
                        times[n].append(do_bench(fn, warmup=20, rep=100, return_mode="median") * 1e3)
                    else:
                        times[n].append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3)
            chunk = mla_baseline_chunk(2048, h_q)
            base = do_bench(lambda: mla_baseline(q, kv, idx, SM_SCALE, chunk), warmup=2,
                            rep=20 if prefill else 50, return_mode="median") * 1e3
            flops, nbytes = mla_counts(T, h_q, 2048, fmt)
            rows.append((name, d, errs, times, base, flops, nbytes))
            print(name, f"diff {d:.3g}", {k: tuple(f"{e:.2g}" for e in v) for k, v in errs.items()},
                  {k: [round(t, 1) for t in ts] for k, ts in times.items()}, f"PyTorch {base:.1f}", flush=True)
            q = kv = flat = idx = out = want = res = None
            torch.cuda.empty_cache()
    med = lambda ts: sorted(ts)[len(ts) // 2]  # noqa: E731
    print(f"\n{'case':<18}{'rows µs':>9}{'pair µs':>9}{'change':>8}{'pair pv':>9}{'pair e4':>9}{'default':>9}"
          f"{'TFLOP/s':>9}{'GB/s':>7}{'PyTorch':>9}{'diff':>9}  {'err out/lse rows':<18}{'err pair':<18}"
          f"{'err pair pv':<18}")
    for name, d, errs, t, base, flops, nbytes in rows:
        r, p, pv, df = med(t["rows"]), med(t["pair"]), med(t["pair pv"]), med(t["default"])
        p4 = med(t["pair e4"]) if "pair e4" in t else float("nan")
        best = min(x for x in (p, pv, df, p4) if x == x)
        e = {n: "/".join(f"{x:.1g}" for x in errs[n]) if errs else "-" for n in ("rows", "pair", "pair pv")}
        print(f"{name:<18}{r:9.1f}{p:9.1f}{(p / r - 1) * 100:+7.1f}%{pv:9.1f}{p4:9.1f}{df:9.1f}"
              f"{flops / best / 1e6:9.1f}{nbytes / best / 1e3:7.0f}{base:9.1f}{d:9.2g}  {e['rows']:<18}{e['pair']:<18}"
              f"{e['pair pv']:<18}")
    if forced:
        heads = "".join(f"{f'pair /{ns}':>10}" for ns in forced)
        print(f"\n{'case':<18}{'pair µs':>9}{heads}   (forced splits)")
        for name, d, errs, t, *_ in rows:
            if f"pair /{forced[0]}" in t:
                print(f"{name:<18}{med(t['pair']):9.1f}" + "".join(f"{med(t[f'pair /{ns}']):10.1f}" for ns in forced))


if __name__ == "__main__":
    main()
