"""Does the L2 fetch granularity change what the small-record reads cost?

    python benchmarks/l2_fetch.py [rounds]

A read that misses L2 fetches more than the 32-byte sectors it asks for: the driver's
``CU_LIMIT_MAX_L2_FETCH_GRANULARITY`` (a hint, 0-128 bytes; ``cudaLimitMaxL2FetchGranularity`` in the runtime)
sets how much. A block-1 indexer key is 132 bytes at a 4-byte-aligned address: in 64-byte units it always covers
three (192 bytes), in 32-byte sectors five (160 bytes). The read-only walk of such keys at random tops out at 2576
GB/s and DRAM reads 1.46x the keys' bytes (BENCHMARKS.md, nineteenth session), so the 3 TB/s goal of block-1 decode
logits sits above what 64-byte fetches allow; 32-byte fetches would leave 1.21x.

For each granularity asked for (the default first, then 32, 64, 128; the value the driver reports back is printed),
in interleaved rounds, this times (CUDA-graph medians, ms; GB/s of the records' own bytes):
  * the read-only walk of ``gather_ceiling.py sizes`` over random rows of 128, 132, 656 and 1152 bytes,
  * ``fp8_paged_mqa_logits`` on the decode goal's inputs (B 64, contexts 32K-128K, shuffled table), blocks 1 and 64,
    next_n 1 and 2,
  * ``sparse_mla`` small-head decode (s_q 1, topk 2048 of 32K per request) at the goal's batch sizes.
The table printed last holds the median of the rounds per granularity, and the PyTorch baseline of each case timed
in the same run at the default granularity (``do_bench`` median): ``index_select`` of the same rows for the walks,
``dsa.bench``'s gather + matmul baselines for the logits and for sparse MLA.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gather_ceiling import rows_sum  # noqa: E402

from dsa import fp8_paged_mqa_logits, sparse_mla  # noqa: E402
from dsa.bench import (bench_ms, indexer_decode_baseline, indexer_decode_inputs, mla_baseline,  # noqa: E402
                       mla_baseline_chunk, mla_inputs)
from dsa.constants import INDEXER_ROW_BYTES  # noqa: E402

CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 5  # CUlimit (cuda.h)
_LIB = None


def _driver():
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL("libcuda.so.1")
    return _LIB


def get_granularity() -> int:
    """The current context's L2 fetch granularity limit, bytes."""
    v = ctypes.c_size_t()
    rc = _driver().cuCtxGetLimit(ctypes.byref(v), CU_LIMIT_MAX_L2_FETCH_GRANULARITY)
    if rc:
        raise RuntimeError(f"cuCtxGetLimit: CUresult {rc}")
    return v.value


def set_granularity(nbytes: int) -> int:
    """Ask for ``nbytes``; returns what the driver then reports."""
    torch.cuda.synchronize()
    rc = _driver().cuCtxSetLimit(CU_LIMIT_MAX_L2_FETCH_GRANULARITY, ctypes.c_size_t(nbytes))
    if rc:
        raise RuntimeError(f"cuCtxSetLimit({nbytes}): CUresult {rc}")
    return get_granularity()


def _ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def cases(dev="cuda"):
    """``(name, fn, bytes, baseline)`` of every timed call (inputs built once; ``baseline`` the same work in
    PyTorch)."""
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    buf = torch.randint(-2**31, 2**31 - 1, (1_400_000_000 // 4, ), dtype=torch.int32, device=dev)
    for row_bytes, count in ((128, 4194304), (132, 4194304), (656, 524288), (1152, 524288)):
        n_rows = buf.numel() * 4 // row_bytes
        rows = buf[:n_rows * row_bytes // 4].view(n_rows, row_bytes // 4)
        idx = torch.randint(0, n_rows, (1, count), generator=g, device=dev).int()
        res = torch.empty(1, count, dtype=torch.int32, device=dev)
        bn, per, st = (64, 8, 3) if row_bytes < 1000 else (64, 1, 1)
        out.append((f"walk {row_bytes} B rows, random", lambda rows=rows, idx=idx, res=res, bn=bn, per=per, st=st:
                    rows_sum(rows, idx, res, bn, triton.cdiv(idx.shape[1], bn * per), st), count * row_bytes,
                    lambda rows=rows, idx=idx: torch.index_select(rows, 0, idx[0])))
    for bs in (1, 64):
        for nn in (1, 2):
            gi = torch.Generator(device=dev).manual_seed(1)
            q, cache, w, ctx, bt, max_len = indexer_decode_inputs(64, 32768, 131072, bs, nn, gi, dev)
            logits = torch.empty(64 * nn, max_len, dtype=torch.float32, device=dev)
            out.append((f"paged logits block {bs} next_n {nn}",
                        lambda q=q, cache=cache, w=w, ctx=ctx, bt=bt, m=max_len, lg=logits:
                        fp8_paged_mqa_logits(q, cache, w, ctx, bt, m, out=lg), float(ctx.sum()) * INDEXER_ROW_BYTES,
                        lambda q=q, cache=cache, w=w, ctx=ctx, bt=bt, m=max_len: indexer_decode_baseline(q, cache, w, ctx,
                                                                                                          bt, m)))
    for fmt, h, b in (("fp8_ds_mla", 16, 32), ("fp8_ds_mla", 16, 64), ("fp8_ds_mla", 16, 128), ("fp8_ds_mla", 32, 64),
                      ("bf16", 16, 32)):
        q, kv, idx = mla_inputs(b, h, 2048, b, 32768, fmt, dev=dev)
        o = torch.empty(b, h, 512, dtype=torch.bfloat16, device=dev)
        row = 656 if fmt != "bf16" else 1152
        out.append((f"sparse_mla {fmt} h{h} batch {b}", lambda q=q, kv=kv, idx=idx, o=o:
                    sparse_mla(q, kv, idx, 192 ** -0.5, out=o), b * 2048 * row,
                    lambda q=q, kv=kv, idx=idx, c=mla_baseline_chunk(2048, h): mla_baseline(q, kv, idx, 192 ** -0.5, c)))
    return out


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.ones(1, device="cuda")
    default = get_granularity()
    print(f"# {torch.cuda.get_device_name()}: L2 fetch granularity limit by default: {default} bytes")
    asks = [default] + [g for g in (32, 64, 128) if g != default]
    got = {}
    cs = cases()
    for c in cs:  # compile and warm every call first
        c[1]()
    times = {}
    for r in range(rounds):
        for a in asks:
            got[a] = set_granularity(a)
            for name, fn, _, _ in cs:
                times.setdefault((name, a), []).append(_ms(fn))
        print(f"# round {r + 1} of {rounds} done", flush=True)
    set_granularity(default)
    base = {name: bench_ms(bl, "cuda", rep=100, warmup=10) for name, _, _, bl in cs}
    head = "".join(f" | asked {a} (got {got[a]})" for a in asks)
    print(f"\n| case{head} | PyTorch (default) |\n|---" + "|---" * (len(asks) + 1) + "|")
    for name, _, nbytes, _ in cs:
        cells = []
        for a in asks:
            ms = statistics.median(times[(name, a)])
            cells.append(f"{ms * 1e3:.1f} us ({nbytes / ms / 1e6:.0f} GB/s)")
        print(f"| {name} | " + " | ".join(cells) + f" | {base[name] * 1e3:.1f} us |")


if __name__ == "__main__":
    main()
