"""Launch-configuration sweeps on a GPU: compile every variant in parallel processes, then time
them one by one in this process (CUDA-graph replays for the microsecond kernels).

    python benchmarks/sweep.py --groups mla_small_h,topk_decode --workers 16 --out sweep.jsonl

Groups (shapes x configs):
  mla_small_h   sparse MLA decode, s_q 1, topk 2048, 32K context per request, h_q 16/32, fp8_ds_mla and
                bf16 caches, batch 1/32/64/128; grid block_n x num_stages x num_warps x num_splits
  mla_prefill_small_h  sparse MLA bf16 prefill h_q 32/16 (tile x warps x stages); prefill with sorted index lists
  mla_small_h_rows     h_q 16/32 decode (both formats, batch 1-128) and bf16 prefill: defaults against the
                Gluon kernel with the gathered rows as the M dimension
  mla_small_h_padded   h_q 16/32 decode (both formats, batch 1-128) and bf16 prefill: defaults against one
                padded 64-head group (the Gluon kernel on sm_90)
  mla_producer  the Hopper Gluon kernel's producer settings against the defaults and the Triton kernel
  mla_pingpong  the Hopper kernel's ping-pong schedule (64-head groups, bf16 cache) against its default one
  mla_cluster   split-K decode merged inside the Hopper kernel (clusters) against the merge kernel, batch 1-64
  mla_fp8_producer  fp8_ds_mla decode, h_q 16/32, batch 1-128: the Hopper kernel's producer (8 warps) against
                one warpgroup
  mla_alt_tiles h_q 16/32 decode (both formats, batch 1-128) and bf16 prefill: the two producer warpgroups on
                alternate tiles against sharing each tile
  mla_large_h   sparse MLA decode fp8 h_q 128 (batch 128 x s_q 2) and bf16 prefill h_q 128
  topk_decode   top-k k=2048 of 64 x 32768, 64 x 131072 and 8 x 65536 rows (decode form)
  topk_prefill  top-k k=2048 of 4096 x 131072 rows
  compile       seconds to compile the default top-k and sparse MLA kernels (fresh Triton cache)

Every variant's result is checked against the default's (the same function: top-k exactly, MLA
within 1/16 absolute); one JSON line per timed variant goes to --out, and the best few of each
shape are printed last. The chosen defaults live in dsa/topk/kernel.py and dsa/mla/kernel.py.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

K = 2048
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ variant lists
def mla_small_h():
    shapes = [(f"mla_{fmt}_h{h}_b{b}", b, h, fmt) for fmt in ("fp8_ds_mla", "bf16") for h in (16, 32)
              for b in (1, 32, 64, 128)]
    cfgs = [dict(block_n=bn, num_stages=st, num_warps=w) for bn, st, w in
            itertools.product((16, 32, 64), (1, 2, 3), (2, 4, 8)) if not (bn == 16 and w == 8) and not (bn == 64 and w == 2)]
    out = []
    for name, b, h, fmt in shapes:
        splits = (1, 2, 4, 8, 16, 32) if b <= 32 else (1, 2, 4, 8)
        for cfg, ns in [({}, None)] + list(itertools.product(cfgs, splits)):  # the default first
            out.append(dict(group="mla_small_h", shape=name, args=(b, 1, h, 32768, fmt), cfg=cfg, ns=ns))
    return out


def mla_small_h_fp8():
    """fp8_ds_mla small-head decode: tile sizes x warps x stages x prefetching the raw fp8 tile by hand."""
    out = []
    cfgs = [dict(block_n=bn, num_warps=w, num_stages=st, prefetch=pf)
            for bn, w, st, pf in itertools.product((16, 32), (4, 8), (1, 2), (True, False))]
    cfgs.append(dict(block_n=16, num_warps=2, num_stages=2, prefetch=False))  # the earlier h16 default
    for h in (16, 32):
        for b in (1, 32, 64, 128):
            name = f"mla_fp8_ds_mla_h{h}_b{b}"
            extra = {1: (8, 16, 32), 32: (2, 4, 8)}.get(b, (1, 2))
            for cfg, ns in [({}, None)] + [(c, None) for c in cfgs] + [(c, n) for c in cfgs if c["prefetch"] for n in extra]:
                out.append(dict(group="mla_small_h_fp8", shape=name, args=(b, 1, h, 32768, "fp8_ds_mla"), cfg=cfg, ns=ns))
    return out


PADDED_64 = dict(block_h=64, block_n=64, num_warps=8, num_stages=2, prefetch=False, per_sm=None)


from dsa.mla.kernel import SM90_ROWS_SMALL_HEADS as ROWS  # noqa: E402 (after the sys.path line above)


def mla_small_h_rows():
    """Small head counts (16, 32): the defaults against the Gluon kernel with the rows as the M dimension
    (``rows``, split counts around one program per SM), decode over both formats and bf16 prefill."""
    out = []
    for fmt in ("fp8_ds_mla", "bf16"):
        for h in (16, 32):
            for b in (1, 32, 64, 128):
                name = f"mla_{fmt}_h{h}_b{b}"
                alt = {1: (8, 32), 32: (2, 8), 64: (1, 4), 128: (2,)}[b]
                for cfg, ns in [({}, None), (ROWS, None)] + [(ROWS, n) for n in alt]:
                    out.append(dict(group="mla_small_h_rows", shape=name, args=(b, 1, h, 32768, fmt), cfg=cfg, ns=ns))
    for h in (32, 16):
        for cfg in ({}, ROWS):
            out.append(dict(group="mla_small_h_rows", shape=f"mla_bf16_prefill_h{h}", args=(1, 4096, h, 131072, "bf16"),
                            cfg=cfg, ns=None))
    return out


def mla_small_h_padded():
    """Small head counts (16, 32) at their defaults against the same call padded to one 64-head group
    (which takes the Gluon kernel on sm_90): decode over both formats, batch 1-128, and bf16 prefill."""
    out = []
    for fmt in ("fp8_ds_mla", "bf16"):
        for h in (16, 32):
            for b in (1, 32, 64, 128):
                name = f"mla_{fmt}_h{h}_b{b}"
                for cfg, ns in [({}, None), (PADDED_64, None), (PADDED_64, 2 if b >= 64 else 8)]:
                    out.append(dict(group="mla_small_h_padded", shape=name, args=(b, 1, h, 32768, fmt), cfg=cfg,
                                    ns=ns))
    for h in (32, 16):
        for cfg in ({}, PADDED_64):
            out.append(dict(group="mla_small_h_padded", shape=f"mla_bf16_prefill_h{h}",
                            args=(1, 4096, h, 131072, "bf16"), cfg=cfg, ns=None))
    return out


def mla_decode_defaults():
    """Decode at the default configuration only: small head groups at batch 1-128 and h_q 128 at batch 1, s_q 2."""
    shapes = [(f"mla_{fmt}_h{h}_b{b}", (b, 1, h, 32768, fmt)) for fmt in ("fp8_ds_mla", "bf16") for h in (16, 32)
              for b in (1, 32, 64, 128)]
    shapes.append(("mla_fp8_ds_mla_h128_b1_sq2", (1, 2, 128, 32768, "fp8_ds_mla")))
    return [dict(group="mla_decode_defaults", shape=name, args=args, cfg={}, ns=None) for name, args in shapes]


def mla_large_h():
    out = []
    cfgs = [dict(block_n=bn, num_stages=st, num_warps=8) for bn, st in itertools.product((32, 64), (1, 2, 3))]
    for cfg in [{}] + cfgs:
        out.append(dict(group="mla_large_h", shape="mla_fp8_h128_b128_sq2", args=(128, 2, 128, 32768, "fp8_ds_mla"),
                        cfg=cfg, ns=None))
        out.append(dict(group="mla_large_h", shape="mla_bf16_prefill_h128", args=(1, 4096, 128, 131072, "bf16"),
                        cfg=cfg, ns=None))
    return out


def mla_producer():
    """The Hopper Gluon kernel's producer warpgroup settings (registers; fp8 groups loaded before the buffer is
    free) against the defaults and the Triton kernel: 64-head groups (bf16 prefill h_q 128 / 64, decode batch
    128 x s_q 2 fp8 h_q 128 / 64 and bf16 h_q 128, fp8 h_q 128 at batch 1) and 16/32-head groups (decode s_q 1
    at batch 1 / 64 / 128, bf16 prefill)."""
    big = [("mla_bf16_prefill_h128", (1, 4096, 128, 131072, "bf16")), ("mla_bf16_prefill_h64", (1, 4096, 64, 131072, "bf16")),
           ("mla_fp8_h128_b128_sq2", (128, 2, 128, 32768, "fp8_ds_mla")),
           ("mla_fp8_h64_b128_sq2", (128, 2, 64, 32768, "fp8_ds_mla")),
           ("mla_bf16_h128_b128_sq2", (128, 2, 128, 32768, "bf16")),
           ("mla_fp8_ds_mla_h128_b1_sq2", (1, 2, 128, 32768, "fp8_ds_mla"))]
    small = [(f"mla_{fmt}_h{h}_b{b}", (b, 1, h, 32768, fmt)) for fmt in ("fp8_ds_mla", "bf16") for h in (16, 32)
             for b in (1, 32, 64, 128)] + [(f"mla_bf16_prefill_h{h}", (1, 4096, h, 131072, "bf16")) for h in (32, 16)]
    prods = [dict(regs=96, early=2), dict(regs=120, early=4)]
    return [dict(group="mla_producer", shape=n, args=a, cfg=c, ns=None) for n, a in big + small
            for c in [{}, dict(gluon=False)] + [dict(ROWS if a[2] < 64 else {}, producer=p) for p in prods]]


def mla_pingpong():
    """64-head groups over the bf16 cache: the Hopper kernel's ping-pong schedule (the two math warpgroups own
    alternate tiles; the default) against its shared-tile schedule and the Triton kernel: prefill h_q 128 / 64,
    decode batch 128 x s_q 2 at h_q 128 / 64 and batch 1 x s_q 2 at h_q 128."""
    shapes = [("mla_bf16_prefill_h128", (1, 4096, 128, 131072, "bf16")), ("mla_bf16_prefill_h64", (1, 4096, 64, 131072, "bf16"))]
    shapes += [(f"mla_bf16_h{h}_b{b}_sq2", (b, 2, h, 32768, "bf16")) for h, b in ((128, 128), (64, 128), (128, 1))]
    cfgs = [{}, dict(pingpong=False), dict(gluon=False)]
    # two rounds (the second's shapes end in "/2"): a difference smaller than the spread between rounds is noise
    return [dict(group="mla_pingpong", shape=n + r, args=a, cfg=c, ns=None) for r in ("", "/2") for n, a in shapes
            for c in cfgs]


def mla_cluster():
    """Split-K decode with the splits merged inside the Hopper kernel (a cluster of CTAs per (token, head group))
    against the merge kernel: the default, ``cluster=False`` and ``cluster=True`` (whatever the CTA count); h_q
    16/32 (s_q 1; 32 heads of at most 4 tokens as two 16-head groups, as the default) and 64/128 (s_q 2), both
    formats, batch 1-64."""
    shapes = [(f"mla_{fmt}_h{h}_b{b}", (b, 1, h, 32768, fmt)) for fmt in ("fp8_ds_mla", "bf16") for h in (16, 32)
              for b in (1, 4, 16, 32, 64)]
    shapes += [(f"mla_{fmt}_h{h}_b{b}_sq2", (b, 2, h, 32768, fmt)) for fmt in ("fp8_ds_mla", "bf16")
               for h, b in ((128, 1), (128, 4), (64, 1))]
    out = []
    for name, a in shapes:
        b, h = a[0], a[2]
        base = dict(ROWS, block_h=16 if h == 16 or b <= 4 else 32) if h < 64 else {}
        for c in ({}, dict(base, cluster=False), dict(base, cluster=True)):
            out.append(dict(group="mla_cluster", shape=name, args=a, cfg=c, ns=None))
    return out


def mla_fp8_producer():
    """fp8_ds_mla decode with 16/32-head groups (s_q 1, 32K context, batch 1-128): the Hopper kernel's producer
    (:data:`dsa.mla.kernel_sm90.PRODUCER_ROWS_FP8`: 8 warps) against one warpgroup and against 8 warps with 96
    registers and two groups loaded early; two rounds (shapes ending in "/2")."""
    prods = [dict(warps=4, regs=120, early=4), dict(warps=8, regs=96, early=2)]
    out = []
    for r in ("", "/2"):
        for h in (16, 32):
            for b in (1, 4, 32, 64, 128):
                base = dict(ROWS, block_h=16 if h == 16 or b <= 4 else 32)
                for c in [{}] + [dict(base, producer=p) for p in prods]:
                    out.append(dict(group="mla_fp8_producer", shape=f"mla_fp8_ds_mla_h{h}_b{b}{r}",
                                    args=(b, 1, h, 32768, "fp8_ds_mla"), cfg=c, ns=None))
    return out


def mla_alt_tiles():
    """Decode with 16/32-head groups (s_q 1, 32K context, batch 1-128) and bf16 prefill h_q 16/32: the two producer
    warpgroups on alternate tiles (:func:`dsa.mla.kernel_sm90.alternate_tiles`) against sharing every tile: for the
    fp8_ds_mla cache the default (alternate from ``PRODUCER_ROWS_FP8["alt"]`` tiles per program) against ``alt`` 0,
    for bf16 the default (one warpgroup) against two on alternate tiles; two rounds (shapes ending in "/2")."""
    out = []
    for r in ("", "/2"):
        for fmt in ("fp8_ds_mla", "bf16"):
            alt = dict(alt=0) if fmt == "fp8_ds_mla" else dict(warps=8, alt=1)
            for h in (16, 32):
                for b in (1, 4, 8, 16, 32, 64, 128):
                    base = dict(ROWS, block_h=16 if h == 16 or b <= 4 else 32)
                    for c in ({}, dict(base, producer=alt)):
                        out.append(dict(group="mla_alt_tiles", shape=f"mla_{fmt}_h{h}_b{b}{r}",
                                        args=(b, 1, h, 32768, fmt), cfg=c, ns=None))
        for h in (16, 32):
            for c in ({}, dict(ROWS, block_h=h, producer=dict(warps=8, alt=1))):
                out.append(dict(group="mla_alt_tiles", shape=f"mla_bf16_prefill_h{h}{r}", args=(1, 4096, h, 131072, "bf16"),
                                cfg=c, ns=None))
    return out


def mla_prefill_small_h():
    """bf16 prefill, T 4096, topk 2048 of 128K, h_q 32 and 16: tile x warps x stages; and every
    prefill shape (h_q 128 too) with each token's index list sorted ascending (the order top-k emits)."""
    out = []
    cfgs = [dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in
            itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)) if not (bn == 128 and st == 4)]
    for h in (32, 16):
        for cfg in [{}] + cfgs:
            out.append(dict(group="mla_prefill_small_h", shape=f"mla_bf16_prefill_h{h}", args=(1, 4096, h, 131072, "bf16"),
                            cfg=cfg, ns=None))
    for h in (128, 32, 16):
        out.append(dict(group="mla_prefill_small_h", shape=f"mla_bf16_prefill_h{h}_sorted",
                        args=(1, 4096, h, 131072, "bf16", True), cfg={}, ns=None))
    return out


def topk_decode():
    out = []
    for M, N in ((64, 32768), (64, 131072), (8, 65536)):
        out.append(dict(group="topk_decode", shape=f"topk_{M}x{N}", args=(M, N, True), cfg={}))  # the default
        for sp, mw, sw, row, nreg, ptx in itertools.product((4, 8), (8, 16), (8, 16), (16, 32), (None, 64, 80), (True,)):
            out.append(dict(group="topk_decode", shape=f"topk_{M}x{N}", args=(M, N, True),
                            cfg=dict(splits=sp, merge_warps=mw, split_warps=sw, row=row, maxnreg=nreg, ptx=ptx)))
        out.append(dict(group="topk_decode", shape=f"topk_{M}x{N}", args=(M, N, True), cfg=dict(splits=1)))
    return out


def topk_prefill():
    out = [dict(group="topk_prefill", shape="topk_4096x131072", args=(4096, 131072, False), cfg={})]
    grid = [dict(block=bl, num_warps=w, programs_per_sm=pps, row=row, maxnreg=nreg)
            for (bl, w), pps, row, nreg in itertools.product(((512, 2), (1024, 4), (2048, 8)), (16, 32), (16, 32, 64),
                                                            (48, 56, 64))]
    for cfg in grid:
        out.append(dict(group="topk_prefill", shape="topk_4096x131072", args=(4096, 131072, False), cfg=cfg))
    return out


GROUPS = dict(mla_alt_tiles=mla_alt_tiles, mla_fp8_producer=mla_fp8_producer, mla_cluster=mla_cluster, mla_pingpong=mla_pingpong, mla_producer=mla_producer, mla_decode_defaults=mla_decode_defaults, mla_small_h_padded=mla_small_h_padded,
              mla_small_h_rows=mla_small_h_rows, mla_prefill_small_h=mla_prefill_small_h, mla_small_h=mla_small_h, mla_small_h_fp8=mla_small_h_fp8, mla_large_h=mla_large_h, topk_decode=topk_decode, topk_prefill=topk_prefill)


# ------------------------------------------------------------------------------ inputs and calls
_CACHE = {}


def mla_case(b, s_q, h, s_kv, fmt, sort=False, tiny=False):
    from dsa.bench import mla_inputs

    key = ("mla", b, s_q, h, s_kv, fmt, sort, tiny)
    if key not in _CACHE:
        _CACHE.clear()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        T, topk, nreq, skv = (2, 128, 1, 256) if tiny else (b * s_q, K, b, s_kv)
        q, kv, idx = mla_inputs(T, h, topk, nreq, skv, fmt, dev=DEV)
        if sort:
            idx = torch.sort(idx, dim=1).values
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device=DEV)
        _CACHE[key] = (q, flat, idx, out)
    return _CACHE[key]


def mla_fn(v, tiny=False, ns=None):
    from dsa.mla.kernel import sparse_mla_triton

    q, flat, idx, out = mla_case(*v["args"], tiny=tiny)
    cfg, ns = v["cfg"], (v["ns"] if ns is None else ns)
    return (lambda: sparse_mla_triton(q, flat, idx, 192 ** -0.5, 512, None, None, out, num_splits=ns, config=cfg)), out


def topk_case(M, N, decode, tiny=False):
    key = ("topk", M, N, decode, tiny)
    if key not in _CACHE:
        _CACHE.clear()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        if tiny:
            M, N = min(M, 4), 32768
        g = torch.Generator(device=DEV).manual_seed(0)
        # several inputs, used in turn, so that they do not stay in the 60 MB L2 between calls
        xs = [torch.randn(M, N, device=DEV, generator=g) for _ in range(1 if tiny else max(1, (256 << 20) // (M * N * 4)))]
        lens = torch.full((M,), N, dtype=torch.int32, device=DEV)
        starts = torch.zeros(M, dtype=torch.int32, device=DEV)
        out = torch.empty(M, K, dtype=torch.int32, device=DEV)
        _CACHE[key] = (xs, lens, starts, out)
    return _CACHE[key]


def topk_fn(v, tiny=False):
    from dsa.topk import TopKConfig, top_k_indices

    M, N, decode = v["args"]
    xs, lens, starts, out = topk_case(M, N, decode, tiny)
    cfg = TopKConfig(**v["cfg"])
    it = [0]

    def fn():
        x = xs[it[0] % len(xs)]
        it[0] += 1
        if decode:
            return top_k_indices(x, K, seq_lens=lens, out=out, config=cfg, backend="triton")
        return top_k_indices(x, K, starts, lens, out=out, config=cfg, backend="triton")
    return fn, out


def fn_for(v, tiny=False):
    return mla_fn(v, tiny) if v["group"].startswith("mla") else topk_fn(v, tiny)


def _compile(chunk):
    """Worker: run each variant once on tiny inputs (fills the shared Triton disk cache)."""
    bad = []
    for v in chunk:
        try:
            if v["group"].startswith("mla"):  # both kernels: without and with split-K (a runtime count)
                for ns in (1, 2):
                    mla_fn(v, tiny=True, ns=ns)[0]()
            else:
                fn_for(v, tiny=True)[0]()
            _sync()
        except Exception as e:  # noqa: BLE001 - reported, the variant is then skipped
            bad.append((v["shape"], v["cfg"], v.get("ns"), f"{type(e).__name__}: {str(e)[:160]}"))
    return bad


# ------------------------------------------------------------------------------ compile-time probe
_PROBE = r"""
import time, torch, sys
sys.path.insert(0, '.')
from dsa.topk import top_k_indices
from dsa.mla.kernel import sparse_mla_triton
from dsa.bench import mla_inputs
res = {}
for name, M, N in (("topk fused", 4096, 8192), ("topk split+merge", 8, 65536)):
    x = torch.randn(M, N, device="cuda"); lens = torch.full((M,), N, dtype=torch.int32, device="cuda")
    t = time.time(); top_k_indices(x, 2048, seq_lens=lens, backend="triton"); _sync()
    first = time.time() - t
    t = time.time(); top_k_indices(x, 2048, seq_lens=lens, backend="triton"); _sync()
    res[name] = (first, time.time() - t)
for name, T, h, fmt in (("mla fp8 h128", 256, 128, "fp8_ds_mla"), ("mla fp8 h16 split", 2, 16, "fp8_ds_mla")):
    q, kv, idx = mla_inputs(T, h, 2048, 1, 32768, fmt, dev="cuda"); flat = kv.reshape(-1, kv.shape[-1])
    t = time.time(); sparse_mla_triton(q, flat, idx, 0.07); torch.cuda.synchronize(); first = time.time() - t
    t = time.time(); sparse_mla_triton(q, flat, idx, 0.07); _sync()
    res[name] = (first, time.time() - t)
for k, (a, b) in res.items():
    print(f"compile  {k:<22} first call {a:7.2f} s   second {b * 1e3:7.2f} ms")
"""


def compile_probe():
    env = dict(os.environ, TRITON_CACHE_DIR="/tmp/triton_fresh_cache_probe")
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout + r.stderr[-2000:], flush=True)


# ------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="mla_small_h,topk_decode")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--out", default="sweep.jsonl")
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds; later variants are skipped")
    ap.add_argument("--top", type=int, default=4)
    args = ap.parse_args()
    t0 = time.time()
    groups = args.groups.split(",")
    if "compile" in groups:
        compile_probe()
        groups.remove("compile")
    variants = [v for g in groups for v in GROUPS[g]()]
    print(f"{len(variants)} variants; compiling with {args.workers} processes", flush=True)
    chunks = [variants[i::args.workers] for i in range(args.workers)]
    with ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
        bad = [b for r in ex.map(_compile, chunks) for b in r]
    bad_keys = {(s, json.dumps(c, sort_keys=True), n) for s, c, n, _ in bad}
    for b in bad[:20]:
        print("compile failed:", b, flush=True)
    print(f"compiled in {time.time() - t0:.0f} s ({len(bad)} failed)", flush=True)
    from triton.testing import do_bench, do_bench_cudagraph

    results, ref = [], {}
    with open(args.out, "w") as f:
        for v in variants:
            if time.time() - t0 > args.deadline:
                print(f"deadline: stopped before {v['shape']} {v['cfg']}", flush=True)
                break
            if (v["shape"], json.dumps(v["cfg"], sort_keys=True), v.get("ns")) in bad_keys:
                continue
            try:
                fn, out = fn_for(v)
                fn()
                _sync()
                o = out.clone()
                if v["shape"] not in ref:
                    ref[v["shape"]] = o
                elif v["group"].startswith("mla"):
                    d = (o.float() - ref[v["shape"]].float()).abs().max().item()
                    if not d <= 0.0625:
                        print(f"WRONG {v['shape']} {v['cfg']} ns={v.get('ns')}: max diff {d}", flush=True)
                        continue
                elif not torch.equal(o, ref[v["shape"]]):
                    print(f"WRONG {v['shape']} {v['cfg']}", flush=True)
                    continue
                long = v["shape"].startswith("mla_bf16_prefill") or v["shape"] == "topk_4096x131072"
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median") if long else \
                    do_bench_cudagraph(fn, rep=25, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"FAILED {v['shape']} {v['cfg']} ns={v.get('ns')}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            r = dict(group=v["group"], shape=v["shape"], cfg=v["cfg"], ns=v.get("ns"), us=ms * 1e3)
            results.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
    print(f"timed {len(results)} variants in {time.time() - t0:.0f} s total", flush=True)
    by_shape = {}
    for r in results:
        by_shape.setdefault(r["shape"], []).append(r)
    for shape, rs in by_shape.items():
        rs.sort(key=lambda r: r["us"])
        print(f"== {shape}  ({len(rs)} variants; worst {rs[-1]['us']:.1f} us)")
        for r in rs[:args.top]:
            print(f"   {r['us']:9.1f} us  ns={r['ns']}  {r['cfg']}")


if __name__ == "__main__":
    main()
