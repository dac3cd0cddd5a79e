"""What-if timings of ``dsa.mla.kernel_sm90``'s 16/32-head path (one math warpgroup, the rows as M, producer
warpgroups filling two tile buffers): which side sets the time per tile? Each variant is the module's source with
one kind of work removed (WRONG values), imported under another name and swapped in for the real module while
``sparse_mla_triton`` runs, in interleaved rounds with the real kernel.

* ``nocopy``: the producers signal each buffer full without filling it (bf16: no ``cp.async``; fp8_ds_mla: no row
  loads, no dequantisation, no stores). The math runs on stale buffers: its time alone, with the barriers.
* ``nomath``: the math warpgroup waits for each buffer and releases it at once: no products, no softmax. The
  producers' fill alone (its copies still meet the L2 and DRAM traffic of the real call).
* ``nosoftmax``: P is the raw logits (no max, no exp, no rescale); 16-head groups (the 32-head groups' lazy
  softmax is a different block: ``nolazy+nosoftmax`` turns it off first).
* ``nolazy``: the 32-head groups take the plain softmax (``LAZY_MAX`` empty).
* ``nowait``: neither side waits for the other (the math not for ``full``, the producers not for ``empty``): both do
  all their work at once, on whatever the buffers hold. About the fill alone or the math alone (whichever is longer):
  the real kernel loses its time to the hand-offs (more buffering would help); about the real time: the two slow
  each other down where they run together (shared memory, issue slots), and no schedule of the same work helps.
* ``loadonly`` (fp8_ds_mla; with ``nomath``): the producers load every raw row and scale as before, but store only a
  quarter of the tile, from the four groups XOR-ed as bytes (one conversion instead of four): the fill's loads alone.
* ``fewstores`` (fp8_ds_mla; with ``nomath``): every group dequantised as before, only their sum stored (a quarter of
  the stores): the fill without three quarters of its shared-memory stores.
* ``cg``: not a what-if but a candidate: the fp8 producers' row loads cached in L2 only (``.cg``; right values).
* ``tpr8``: a candidate: 8 producer threads per row on alternate tiles too (one 128-byte request per row and group).
* ``trace``: not a what-if but a measurement: the real kernel with ``%clock`` read at eight points of the math
  warpgroup's loop (:data:`TRACE_POINTS`), each thread summing the clocks between them; printed per tile (the
  mean over the math threads and CTAs; the lazy softmax's points at 32 heads, the plain one's at 16 heads and
  with ``nolazy``). The clock reads themselves add a few instructions to the chain.
* ``none``: ``nocopy`` and ``nomath``: the barriers, the index lists, q, the epilogue and the launch (its CTAs keep
  only q's shared memory, so several may share an SM).

Variants combine with ``+``. If the real time is about ``nomath``'s, the fill sets the tile; if about ``nocopy``'s,
the math chain; if above both, the two do not overlap (two buffers leave no slack), and more buffers or a shorter
chain would each help.

    python benchmarks/whatif_sm90.py [--variants=real,nomath,...] [--base=OLD.py] [--as-given] [ROUNDS] [CASE ...]
    (GPU; sm_90)

``--base=OLD.py`` (another source of ``kernel_sm90``, e.g. ``git show REV:dsa/mla/kernel_sm90.py``) times each variant
of it too, as ``base:VARIANT``, in the same interleaved rounds. ``--as-given``: many-token calls take the index lists
as given, not grouped by slot range first (``order=False``; the rest of the dispatch unchanged), e.g. to see whether
the fill alone depends on the SMs reading the same slot ranges at once.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from whatif_bulk import import_source  # noqa: E402

from dsa.bench import interleaved_us, mla_inputs  # noqa: E402
from dsa.mla import kernel as K  # noqa: E402
from dsa.mla import kernel_sm90  # noqa: E402

# (name, T, h_q, topk, num_req, s_kv, format)
CASES = [
    ("prefill_bf16_h16", 4096, 16, 2048, 1, 131072, "bf16"),
    ("prefill_bf16_h32", 4096, 32, 2048, 1, 131072, "bf16"),
    ("decode_fp8_h32_b32", 32, 32, 2048, 32, 32768, "fp8_ds_mla"),
    ("decode_fp8_h32_b64", 64, 32, 2048, 64, 32768, "fp8_ds_mla"),
    ("decode_fp8_h32_b128", 128, 32, 2048, 128, 32768, "fp8_ds_mla"),
    ("decode_bf16_h16_b32", 32, 16, 2048, 32, 32768, "bf16"),
    ("prefill_fp8_h16", 4096, 16, 2048, 1, 131072, "fp8_ds_mla"),
    ("prefill_fp8_h32", 4096, 32, 2048, 1, 131072, "fp8_ds_mla"),
    ("decode_fp8_h16_b16", 16, 16, 2048, 16, 32768, "fp8_ds_mla"),
]
VARIANTS = ["real", "nomath", "nocopy", "nowait", "nosoftmax", "nolazy", "nolazy+nosoftmax", "none"]

MATH_START = "        kn = k_nope_smem.index(s)\n"
MATH_END = ("        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))\n"
            "        gl.thread_barrier()  # every warp")
FILL_START = "        if IS_FP8:  # EARLY (2 or 4)"
FILL_WAIT = "        mbarrier.wait(empty.index(s), ((i // 2) & 1) ^ 1)\n"
FILL_END = "        if not LATE:\n"
MATH_WAIT = "        mbarrier.wait(full.index(s), (i // 2) & 1)\n"
FP8_STORES = "            kn.slice(0 * 128, 128, dim=1).store((r0.to(gl.float32) * s0[:, None]).to(gl.bfloat16))\n"
FP8_LATER_STORES = "".join(f"            kn.slice({g} * 128, 128, dim=1).store((r{g}.to(gl.float32) * s{g}[:, None])"
                           ".to(gl.bfloat16))\n" for g in (1, 2, 3))
SOFTMAX = "            p, alpha, l_2d, m_i = _softmax_step(sc, _idx_valid(idx_t, S), m_i, l_2d, sm_scale_log2, 1)\n"

#: the trace's phases, in loop order: (name, the source line the clock is read after, or before with a leading "<";
#: then, for the phases inside the softmax, the same point in the plain softmax's branch: 16-head groups, ``nolazy``)
TRACE_POINTS = [
    ("wait full", "        mbarrier.wait(full.index(s), (i // 2) & 1)\n"),
    ("QK", "        sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))\n"),
    ("softmax, P stored", "<            fence_async_shared()\n            gl.thread_barrier()\n            if _grow_get(",
     "<            fence_async_shared()\n            gl.thread_barrier()\n            alpha_o = "),
    ("fence", "<            gl.thread_barrier()\n            if _grow_get(",
     "<            gl.thread_barrier()\n            alpha_o = "),
    ("barrier", "            gl.thread_barrier()\n            if _grow_get(",
     "            gl.thread_barrier()\n            alpha_o = "),
    ("to the P.V issue",
     "<            acc = warpgroup_mma(kn.slice(0, DV, dim=1).permute((1, 0)), p_smem, acc, is_async=True)\n",
     "<            acc = warpgroup_mma(kn.slice(0, DV, dim=1).permute((1, 0)), p_smem, acc * alpha_o[None, :], "),
    ("P.V", MATH_END),
    ("release, loop", "        mbarrier.arrive(empty.index(s))\n\n    l_i = gl.sum(l_2d, 0)"),
]
TRACE_HELPER = """
from dsa.mla.kernel_bulk import _clock  # (the bulk kernel's TRACE: each thread's %clock)


@gluon.jit
def _trace_store(trace_ptr, k: gl.constexpr, v):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pid = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
    tid = gl.arange(0, 128, lay)
    gl.store(trace_ptr + (pid.to(gl.int64) * 128 + tid) * 16 + k, v)
"""


def _trace(src: str) -> str:
    """The ``trace`` variant's source (32-head groups: the lazy softmax's lines; the module's ``TRACE`` buffer passed
    as the unused ``skip_ptr``)."""
    a = src.index("def _math_rows(")
    b = src.index("\n@gluon.jit", a)
    body = src[a:b]
    old = "SPLIT: gl.constexpr, m_smem=None, LAZY: gl.constexpr = False):"
    assert body.count(old) == 1
    body = body.replace(old, "SPLIT: gl.constexpr, m_smem=None, LAZY: gl.constexpr = False, trace_ptr=None):")
    loop = "    for i in range(n_tiles):\n"
    assert body.count(loop) == 1
    n = len(TRACE_POINTS)
    init = "".join(f"    tr{k} = gl.zeros([128], gl.int32, gl.BlockedLayout([1], [32], [4], [0]))\n" for k in range(n))
    body = body.replace(loop, init + loop + "        c_prev = _clock(4)\n")
    for k, (_, *anchors) in enumerate(TRACE_POINTS):
        read = (f"{{ind}}c_now = _clock(4)\n{{ind}}tr{k} += c_now - c_prev\n{{ind}}c_prev = c_now\n")
        for at in anchors:  # (one runs: the lazy branch or the plain one, a constexpr choice)
            before = at.startswith("<")
            at = at.lstrip("<")
            assert body.count(at) == 1, at
            j = body.index(at)
            line = at.split("\n")[0] + "\n"
            ind = line[:len(line) - len(line.lstrip(" "))]
            code = read.format(ind=ind)
            if not before:
                j += len(line)
            body = body[:j] + code + body[j:]
    tail = "    l_i = gl.sum(l_2d, 0)\n"
    assert body.count(tail) == 1
    stores = "".join(f"    _trace_store(trace_ptr, {k}, tr{k})\n" for k in range(n))
    stores += f"    _trace_store(trace_ptr, {n}, tr0 * 0 + n_tiles)\n"
    body = body.replace(tail, stores + tail)
    src = src[:a] + body + src[b:]
    old = "SPLIT, m_smem, LAZY)),"
    assert src.count(old) == 2
    src = src.replace(old, "SPLIT, m_smem, LAZY, skip_ptr)),")
    old = "        lse if skip is None else skip[0], T,"
    assert src.count(old) == 1
    src = src.replace(old, "        _trace_buffer(grid, max(cluster, 1), q.device), T,")
    src = src.replace("\ndef launch(", """
TRACE = None


def _trace_buffer(grid, cluster, device):
    global TRACE  # (every CTA (clusters: grid[0] * cluster of them) stores the slots that are read: no memset)
    TRACE = torch.empty(grid[0] * cluster * grid[1] * 128 * 16, dtype=torch.int32, device=device)
    return TRACE


def launch(""", 1)
    i = src.index("\n@gluon.jit\ndef _math_rows(")
    return src[:i] + TRACE_HELPER + src[i:]


def trace_table(mod) -> list:
    """Clocks per tile of each phase (mean over the math threads of the CTAs that ran tiles) from ``mod.TRACE``."""
    t = mod.TRACE.view(-1, 128, 16).to(torch.float64)
    n = len(TRACE_POINTS)
    ran = t[:, 0, n] > 0
    per = t[ran][:, :, :n] / t[ran][:, :, n:n + 1]
    return [round(x, 1) for x in per.mean(dim=(0, 1)).tolist()]


def _wrap(src: str, where: str, start: str, end: str, keep_start: bool, cond: str) -> str:
    """``src`` with the lines from the first ``start`` after ``where`` (after ``start`` itself if ``keep_start``) up
    to the next ``end`` under ``if cond:``."""
    assert src.count(where) == 1, f"the source no longer holds {where!r}"
    a = src.index(start, src.index(where)) + (len(start) if keep_start else 0)
    b = src.index(end, a)
    body = src[a:b]
    indent = body[:len(body) - len(body.lstrip(" "))]
    block = "".join("    " + line if line.strip() else line for line in body.splitlines(keepends=True))
    return src[:a] + f"{indent}if {cond}:\n" + block + src[b:]


def _drop(src: str, where: str, line: str) -> str:
    """``src`` without the first ``line`` after ``where``."""
    assert src.count(where) == 1, f"the source no longer holds {where!r}"
    a = src.index(line, src.index(where))
    return src[:a] + src[a + len(line):]


def variant(name: str, path: str | None = None):
    """The module with variant ``name``'s changes (``+``-joined), imported as ``dsa.mla._whatif_sm90_<name>``; from
    the source at ``path`` (another version of the module) instead of this tree's if given."""
    src = open(path or kernel_sm90.__file__).read()
    parts = set(name.split("+")) - {"real"}
    if "none" in parts:
        parts |= {"nomath", "nocopy"}
    if parts & {"loadonly", "fewstores"}:
        assert src.count(FP8_STORES) == 1 and src.count(FP8_LATER_STORES) == 1
        i8 = [f"r{g}.to(gl.int8, bitcast=True)" for g in range(4)]
        one = ("((" + " ^ ".join(i8) + ").to(gl.float32) * (s0 + s1 + s2 + s3)[:, None]).to(gl.bfloat16)"
               if "loadonly" in parts else
               "(" + " + ".join(f"r{g}.to(gl.float32) * s{g}[:, None]" for g in range(4)) + ").to(gl.bfloat16)")
        src = src.replace(FP8_STORES, f"            kn.slice(0, 128, dim=1).store({one})\n")
        src = src.replace(FP8_LATER_STORES, "")
    if "cg" in parts:  # the fp8 row loads cached in L2 only (ld.global.cg: not allocated in L1)
        for g in range(4):
            old = f"gl.load(base + {g} * 128, mask=m, other=0.0)"
            assert src.count(old) in (1, 2), old
            src = src.replace(old, f"gl.load(base + {g} * 128, mask=m, other=0.0, cache_modifier=\".cg\")")
    if "tpr8" in parts:  # 8 producer threads per row (one 128-byte request per row and group) on alternate tiles too
        old = "TPR: gl.constexpr = 4 if PW == 8 or STEP == 2 else 8"
        assert src.count(old) == 1
        src = src.replace(old, "TPR: gl.constexpr = 8")
    if "nolazy" in parts:
        assert src.count("LAZY_MAX = (32,)") == 1
        src = src.replace("LAZY_MAX = (32,)", "LAZY_MAX = ()")
    if "nosoftmax" in parts:  # (the plain softmax's block only)
        assert src.count(SOFTMAX) == 1
        src = src.replace(SOFTMAX, "            p, alpha = sc, m_i\n")
    if "trace" in parts:
        src = _trace(src)
    if "nomath" in parts:
        src = _wrap(src, "def _math_rows(", MATH_START, MATH_END, False, "False")
        src = src.replace(MATH_END, "        gl.thread_barrier()  # every warp", 1)
    if "nocopy" in parts:  # the producer's loads before its wait, and its fill after it
        src = _wrap(src, "def _producer(", FILL_START, FILL_WAIT, False, "False")
        src = _wrap(src, "def _producer(", FILL_WAIT, FILL_END, True, "False")
    if "nowait" in parts:
        src = _drop(src, "def _math_rows(", MATH_WAIT)
        src = _drop(src, "def _producer(", FILL_WAIT)
    unknown = parts - {"nomath", "nocopy", "nowait", "none", "nosoftmax", "nolazy", "loadonly", "fewstores", "cg",
                       "tpr8", "trace"}
    assert not unknown, unknown
    return import_source(src, "_whatif_sm90_" + name.replace("+", "_") + ("_base" if path else ""))


def compile_sm90(mod, fp8: bool, bh: int):
    """``mod``'s kernel (the real module or a variant) compiled for sm_90a as :func:`kernel_sm90.launch` would
    launch a one-split 16/32-head call over the fp8_ds_mla (``fp8``) or bf16 cache, on any machine (Triton's own
    ptxas; not under the CPU interpreter). Returns the compiled kernel (``.asm``, ``.metadata.shared``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = mod._sparse_mla_sm90_kernel
    prod = mod.producer_config(fp8, bh, False)
    consts = dict(IS_FP8=fp8, HAS_LEN=False, HAS_SINK=False, SPLIT=False, BH=bh, PINGPONG=False,
                  PRODUCER_WARPS=prod["warps"], PRODUCER_REGS=prod["regs"], EARLY=prod["early"], MATH_REGS=0,
                  CLUSTER=0, ALT=mod.alternate_tiles(prod, bh, 2048), LAZY=bh in mod.LAZY_MAX, PERSIST=False, SKIP=-1)
    ptrs = dict(q_ptr="*bf16", nope_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32", rope_ptr="*bf16",
                idx_ptr="*i32", len_ptr="*i32", sink_ptr="*fp32", out_ptr="*bf16", ml_ptr="*fp32", lse_ptr="*fp32",
                fout_ptr="*bf16", fml_ptr="*fp32", flse_ptr="*fp32", skip_ptr="*i32")
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "sm_scale_log2" else "i32")
           for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n), ): [["tt.divisibility", 16]] for n in ptrs}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(n), ): v for n, v in consts.items()}, attrs)
    return mod._compile_with_cluster(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def call_with(mod, *args, **kwargs):
    """``sparse_mla_triton(*args, **kwargs)`` with ``mod`` (a variant, or another source of the module) in
    ``kernel_sm90``'s place for the call."""
    before, K.kernel_sm90 = K.kernel_sm90, mod
    try:
        return K.sparse_mla_triton(*args, **kwargs)
    finally:
        K.kernel_sm90 = before


def applies(v: str, h_q: int) -> bool:
    """Whether variant ``v`` changes anything at ``h_q`` heads (else it is not timed): ``nosoftmax`` alone touches
    16-head groups only (32-head ones take the lazy softmax), ``nolazy`` 32-head ones."""
    parts = set(v.removeprefix("base:").split("+"))
    return not (("nosoftmax" in parts and "nolazy" not in parts and h_q != 16)
                or ("nolazy" in parts and h_q != 32))


def main():
    global VARIANTS
    args = sys.argv[1:]
    base = order = None
    while args and args[0].startswith("--"):
        opt, _, val = args.pop(0).partition("=")
        if opt == "--variants":  # a subset, comma-separated
            VARIANTS = val.split(",")
        elif opt == "--base":  # each variant also from another source of the module, as base:VARIANT
            base = val
        elif opt == "--as-given":  # sparse_mla_triton's order=False
            order = False
        else:
            sys.exit(__doc__)
    rounds = int(args[0]) if args else 3
    names = args[1:]
    mods = {v: kernel_sm90 if v == "real" else variant(v) for v in VARIANTS}
    if base:
        mods.update({"base:" + v: variant(v, base) for v in VARIANTS})
        VARIANTS = [u for v in VARIANTS for u in ("base:" + v, v)]
    sm = 192 ** -0.5
    table = []
    for name, T, h, topk, nreq, s_kv, fmt in CASES:
        if names and name not in names:
            continue
        q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, block_size=64)
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")

        def call(v):
            return call_with(mods[v], q, flat, idx, sm, out=out, order=order)

        times = {v: [float("nan")] for v in VARIANTS}
        runs = []
        for v in VARIANTS:
            if not applies(v, h):
                continue
            try:
                call(v)
                torch.cuda.synchronize()
                runs.append(v)
            except Exception as e:  # e.g. a variant out of shared memory
                print(f"# {name} {v}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        times.update(interleaved_us({v: (lambda v=v: call(v)) for v in runs}, rounds, not name.startswith("prefill")))
        for v in runs:
            if "trace" in v.removeprefix("base:").split("+"):
                call(v)
                torch.cuda.synchronize()
                print(name, v, "clocks per tile:", dict(zip([p[0] for p in TRACE_POINTS], trace_table(mods[v]))),
                      flush=True)
        med = {v: sorted(x)[len(x) // 2] for v, x in times.items()}
        print(name, {v: [round(x, 1) for x in xs] for v, xs in times.items()}, flush=True)
        table.append((name, med))
        q = kv = idx = flat = out = None
        torch.cuda.empty_cache()
    w = {v: max(11, len(v) + 2) for v in VARIANTS}
    print(f"\n{'case (median us)':<22}" + "".join(f"{v:>{w[v]}}" for v in VARIANTS))
    for name, med in table:
        print(f"{name:<22}" + "".join(f"{med[v]:{w[v]}.1f}" for v in VARIANTS))


if __name__ == "__main__":
    main()
