"""How fast can ONE CTA per SM gather sparse-MLA cache rows with Hopper's bulk copy engine, one copy per row?

    python benchmarks/bulk_gather.py ["call 1" | "call 2" | stages | prefill]  # GPU: the 25th / 52nd / 63rd sessions
    python benchmarks/bulk_gather.py --compile-only         # CPU: compile for sm_90a, print the shared-memory offsets

The small-head fp8 decode kernels run one CTA per SM, and their row copies (``cp.async``, 16 bytes per lane, or
loads through L1 into the producers' registers) hold one to three 41 KB tiles in flight per SM. The read-only walk
of the same rows (``gather_ceiling.py``) reaches 3.1-3.3 TB/s only with four or more programs per SM; the copies of
the register-operand prototype took 35 us at batch 64 whatever their depth (BENCHMARKS.md, twenty-second and
twenty-third sessions). The copy engine takes a whole row per instruction (``cp.async.bulk``: any multiple of 16
bytes from a 16-byte-aligned address, 656 for fp8_ds_mla, 1152 for bf16), completes on an mbarrier, and needs no
register or thread per byte in flight, so a few warps can keep a ring of 2-5 tiles of rows in flight. This script
measures that rate on the decode benchmark's rows (T tokens x 2048 random rows of their own request's 32K):

* loader warps: per 64-row tile, wait for the tile's buffer, take the tile's index entries (loaded while the
  previous tile waited), and each lane issues its rows' bulk copies (inline PTX; ptxas turns each into a loop that
  issues one lane's copy at a time, the operands being uniform registers) into the ring, all signalling the
  buffer's mbarrier; an invalid entry copies row 0 (the ring's byte count stays a constant). ``ALT`` 0: one
  partition of ``LW`` warps splitting each tile's rows; ``ALT`` 1: ``LW`` one-warp partitions on alternate tiles.
* a consumer partition of ``CW`` warps waits for each tile and releases it: ``CONSUME`` 0 only waits (the copy
  rate); 1 also reads every word of the tile from shared memory and stores each row's wrapping word sum (what
  ``gather_ceiling.py``'s walk stores), checked against that walk's output, which proves the copies landed where
  the reads look; ``MATH`` adds FMA rounds per tile (how much arithmetic the copies can hide).

Gluon (Triton 3.6) has no bulk-copy op and gives inline PTX no shared-memory address, so the copies address the ring
and its mbarriers as ``global_smem`` (the kernel's dynamic shared memory) plus the offsets the compiler's allocation
pass gives those buffers: the kernel is compiled once, the allocation pass run on its TTGIR
(``dsa.mla.kernel_bulk.allocated``), and the kernel run with the offsets as constants (they do not depend on them).
The ring's rows are linear (no swizzle): a kernel fed this way takes its operands into registers (``ldmatrix`` /
``ld.shared``), not as wgmma's shared-memory operands.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa.constants import H200_COPY_BYTES_PER_S  # noqa: E402
from dsa.mla.kernel_bulk import allocated, offsets, stage_barriers  # noqa: E402,F401

BN = gl.constexpr(64)  # rows per tile


@gluon.jit
def _loader(full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW: gl.constexpr, STAGES: gl.constexpr,
            RING_OFF: gl.constexpr, BAR_OFF: gl.constexpr, LW: gl.constexpr, W: gl.constexpr, STEP: gl.constexpr,
            PIECE: gl.constexpr):
    """Tiles ``W, W + STEP, ...``; each of the partition's ``LW`` warps copies ``BN / LW`` rows of each, each row
    by ``ROW / PIECE`` bulk copies."""
    lay: gl.constexpr = gl.BlockedLayout([BN // (32 * LW)], [32], [LW], [0])
    r = gl.arange(0, BN, lay)
    idx = gl.load(idx_row + start + W * BN + r, mask=start + W * BN + r < stop, other=-1)
    for i in range(W, n_tiles, STEP):
        s = i % STAGES
        ok = (idx >= 0) & (idx < S)
        src = kv_ptr + gl.where(ok, idx, 0).to(gl.int64) * (ROW // 4)
        n = start + (i + STEP) * BN + r  # the next tile's entries, loaded while this one waits for its buffer
        idx = gl.load(idx_row + n, mask=n < stop, other=-1)
        if i >= STAGES:
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        dst = RING_OFF + (s * BN + r) * ROW
        bar = gl.full([BN], BAR_OFF, gl.int32, lay) + s * 8
        mbarrier.expect(full.index(s), BN * ROW)
        for p in gl.static_range(ROW // PIECE):  # one copy per row, or per PIECE bytes of it
            gl.inline_asm_elementwise(
                "{ .reg .u32 a, b; mov.u32 a, global_smem; add.u32 b, a, $3; add.u32 a, a, $1;\n"
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [a], [$2], $4, [b];\n"
                "mov.u32 $0, 0; }", "=r,r,l,r,r", [dst + p * PIECE, src + p * (PIECE // 4), bar,
                                                   gl.full([BN], PIECE, gl.int32, lay)], dtype=gl.int32,
                is_pure=False, pack=1)


@gluon.jit
def _consumer(full, empty, out_row, start, stop, n_tiles, ROW: gl.constexpr, STAGES: gl.constexpr,
              CONSUME: gl.constexpr, RING_OFF: gl.constexpr, MATH: gl.constexpr, CW: gl.constexpr):
    """``CONSUME`` 0: wait and release each tile. 1: read every 16-byte piece of it (``ld.shared``), store each
    row's wrapping word sum, release; with ``MATH`` > 0 also ``MATH`` rounds of one FMA per piece (independent
    chains: ``MATH * BN * 64 / 128`` FMA clocks per tile per SM), kept live by the stored value."""
    C: gl.constexpr = ROW // 16  # 16-byte pieces per row
    CP: gl.constexpr = 64 if C <= 64 else 128
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [CW, 1], [1, 0])
    rr = gl.arange(0, BN, gl.SliceLayout(1, lay))
    cc = gl.arange(0, CP, gl.SliceLayout(0, lay))
    m = (cc < C)[None, :] & (rr >= 0)[:, None]
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(full.index(s), (i // STAGES) & 1)
        if CONSUME:
            a = RING_OFF + (s * BN + rr)[:, None] * ROW + gl.where(m, cc[None, :] * 16, 0)
            w0, w1, w2, w3 = gl.inline_asm_elementwise(
                "{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $4; ld.shared.v4.u32 {$0, $1, $2, $3}, [a]; }",
                "=r,=r,=r,=r,r", [a], dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=False, pack=1)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(s))
            v = gl.sum(gl.where(m, (w0 + w1) + (w2 + w3), 0), axis=1)
            if MATH > 0:
                x = (w0 ^ w3).to(gl.float32) * 1e-9
                for _ in range(MATH):
                    x = x * 0.999 + 0.5
                v += (gl.sum(x, axis=1) > 1e30).to(gl.int32)
            n = start + i * BN + rr
            gl.store(out_row + n, v, mask=n < stop)
        else:
            mbarrier.arrive(empty.index(s))


@gluon.jit
def _bulk_walk_kernel(kv_ptr, idx_ptr, out_ptr, S, topk, chunk, stride_it, stride_o, ROW: gl.constexpr,
                      STAGES: gl.constexpr, CONSUME: gl.constexpr, RING_OFF: gl.constexpr, BAR_OFF: gl.constexpr,
                      LW: gl.constexpr, ALT: gl.constexpr, MATH: gl.constexpr, CW: gl.constexpr, P0: gl.constexpr,
                      P1: gl.constexpr, P2: gl.constexpr, P3: gl.constexpr, PIECE: gl.constexpr):
    """The ring is ``STAGES`` tiles of ``BN`` rows of ``ROW`` bytes back to back, allocated as up to four
    power-of-two int32 buffers of ``P0 >= P1 >= P2 >= P3`` words (0: none) that the compiler must place side by side
    (checked from the TTGIR by :func:`offsets`). ``LW`` loader warps: one partition splitting each tile's rows
    (``ALT`` 0), or ``LW`` one-warp partitions on alternate tiles (``ALT`` 1, ``LW`` <= 4). ``CW`` consumer warps (the
    launch's ``num_warps``). With ``ALT`` 1, ``STAGES`` must be a multiple of ``LW`` (each stage filled by one
    loader: its parity waits cannot tell a phase from the one two before it)."""
    t = gl.program_id(1).to(gl.int64)
    start = gl.program_id(0) * chunk
    stop = gl.minimum(start + chunk, topk)
    n_tiles = gl.cdiv(stop - start, BN)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    b0 = gl.allocate_shared_memory(gl.int32, [P0], flat)
    if P1 > 0:
        b1 = gl.allocate_shared_memory(gl.int32, [P1], flat)
    if P2 > 0:
        b2 = gl.allocate_shared_memory(gl.int32, [P2], flat)
    if P3 > 0:
        b3 = gl.allocate_shared_memory(gl.int32, [P3], flat)
    full, empty = stage_barriers(STAGES)
    out_row = out_ptr + t * stride_o
    idx_row = idx_ptr + t * stride_it
    if ALT == 0:
        gl.warp_specialize([
            (_consumer, (full, empty, out_row, start, stop, n_tiles, ROW, STAGES, CONSUME, RING_OFF, MATH, CW)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, LW,
                       0, 1, PIECE)),
        ], [LW], [48])
    elif LW == 2:
        gl.warp_specialize([
            (_consumer, (full, empty, out_row, start, stop, n_tiles, ROW, STAGES, CONSUME, RING_OFF, MATH, CW)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       0, 2, PIECE)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       1, 2, PIECE)),
        ], [1, 1], [48, 48])
    elif LW == 3:
        gl.warp_specialize([
            (_consumer, (full, empty, out_row, start, stop, n_tiles, ROW, STAGES, CONSUME, RING_OFF, MATH, CW)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       0, 3, PIECE)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       1, 3, PIECE)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       2, 3, PIECE)),
        ], [1, 1, 1], [48, 48, 48])
    else:
        gl.static_assert(LW == 4, "ALT 1 takes 2, 3 or 4 loader warps")
        gl.warp_specialize([
            (_consumer, (full, empty, out_row, start, stop, n_tiles, ROW, STAGES, CONSUME, RING_OFF, MATH, CW)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       0, 4, PIECE)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       1, 4, PIECE)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       2, 4, PIECE)),
            (_loader, (full, empty, kv_ptr, idx_row, start, stop, n_tiles, S, ROW, STAGES, RING_OFF, BAR_OFF, 1,
                       3, 4, PIECE)),
        ], [1, 1, 1, 1], [48, 48, 48, 48])
    b0._keep_alive()
    if P1 > 0:
        b1._keep_alive()
    if P2 > 0:
        b2._keep_alive()
    if P3 > 0:
        b3._keep_alive()


def ring_parts(row: int, stages: int):
    """The ring's bytes (rounded up to 1 KiB) as up to four power-of-two int32 buffer sizes, largest first."""
    words = -(-stages * BN.value * row // 1024) * 256
    parts = [1 << b for b in range(words.bit_length() - 1, -1, -1) if words >> b & 1]
    while len(parts) > 4:  # round the smallest parts up
        parts = parts[:3] + [1 << (sum(parts[3:]) - 1).bit_length()]
    return dict(zip(("P0", "P1", "P2", "P3"), parts + [0] * (4 - len(parts))))


def compile_sm90(fn, consts: dict, ptrs: dict, num_warps: int, floats=(), divisible=()):
    """Compile the Gluon (or plain Triton) kernel ``fn`` for sm_90a on any machine (no GPU needed): ``consts`` its
    constexprs, ``ptrs`` its pointer arguments and their types (16-byte aligned), ``floats`` its fp32 arguments (the
    rest i32; those in ``divisible`` multiples of 16, as the launcher specialises them)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n), ): [["tt.divisibility", 16]] for n in (*ptrs, *divisible)}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource
    src = source(fn, sig, {(fn.arg_names.index(n), ): v for n, v in consts.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def sass_text(kernel) -> str:
    """The compiled kernel's SASS (Triton's bundled ``cuobjdump``)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    return sass


def sass_lines(kernel) -> list:
    """The compiled kernel's SASS as ``(offset, file, line, instruction)`` rows in address order (Triton's bundled
    ``nvdisasm -g``): the source file's base name and line each instruction came from, as Triton's line info
    holds them (``("", 0)`` before the first marker); the instruction with its predicate, without the ``;``, branch
    targets as offsets (``BRA 0x2f40``; an indirect branch's table too: ``BRX R4 -0x1b0 (*"BRANCH_TARGETS
    0x60,0x2f40"*)``)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    text = subprocess.run([os.path.join(tools, "nvdisasm"), "-g", "-c", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    rows, where, labels, pending = [], ("", 0), {}, []
    for raw in text.splitlines():
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', raw)
        if m:
            where = (os.path.basename(m[1]), int(m[2]))
            continue
        m = re.match(r"(\.L_x_\d+):", raw)
        if m:
            pending.append(m[1])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", raw)
        if m:
            labels.update((name, int(m[1], 16)) for name in pending)
            pending = []
            rows.append((int(m[1], 16), *where, m[2]))
    # branch targets as offsets: "BRA `(.L_x_8)" -> "BRA 0x2f40"; "BRANCH_TARGETS .L_x_2,.L_x_8" -> "... 0x60,0x2f40"
    def offsets(i):
        i = re.sub(r"`\((\.L_x_\d+)\)", lambda t: hex(labels[t[1]]), i)
        return re.sub(r"BRANCH_TARGETS ([.\w,]+)",
                      lambda t: "BRANCH_TARGETS " + ",".join(hex(labels[x]) for x in t[1].split(",")), i)

    return [(o, f, n, offsets(i)) for o, f, n, i in rows]


def sass_counts(kernel, prefixes):
    """How many of each SASS instruction starting with one of ``prefixes`` the compiled kernel holds."""
    from collections import Counter

    sass = sass_text(kernel)
    ops = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", sass, re.M))
    return {o: c for o, c in sorted(ops.items()) if o.startswith(tuple(prefixes))}


_ZERO = {}


def zero_row(nbytes: int, dev):
    """``nbytes`` zero bytes on ``dev``, allocated once: the row a prototype's loaders copy for an invalid entry."""
    key = (nbytes, str(dev))
    if key not in _ZERO:
        _ZERO[key] = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    return _ZERO[key]


def poisoned_case(T: int, kv_format: str, dev="cuda"):
    """The prototypes' correctness case: ``(q, flat cache rows, idx)`` of T decode tokens (16 heads, topk 2048 of
    32K each, ``dsa.bench.mla_inputs``) with 5% of the entries invalid (-1 or past the cache), token 1 without any
    valid entry when T is 3, and NaN in every cache row no entry uses (bf16 NaN; 0xFF bytes for fp8_ds_mla: NaN
    values, scales and rope)."""
    from dsa.bench import mla_inputs

    q, kv, idx = mla_inputs(T, 16, 2048, T, 32768, kv_format, seed=T, dev=dev)
    flat = kv.reshape(-1, kv.shape[-1])
    g = torch.Generator(device=dev).manual_seed(7)
    idx = idx.clone()
    bad = torch.rand(idx.shape, generator=g, device=dev) < 0.05
    idx[bad] = torch.where(torch.rand(idx.shape, generator=g, device=dev)[bad] < 0.5, -1, flat.shape[0] + 5
                           ).to(torch.int32)
    if T == 3:
        idx[1] = -1  # a row with no valid entry
    used = torch.zeros(flat.shape[0], dtype=torch.bool, device=dev)
    ok = (idx >= 0) & (idx < flat.shape[0])
    used[idx[ok].long()] = True
    flat[~used] = float("nan") if flat.dtype == torch.bfloat16 else 0xFF
    return q, flat, idx


def baseline_and_floor(q, kv, idx, sm_scale, row_bytes: int, what: str):
    """The PyTorch baseline's time (``dsa.bench.mla_baseline``, ``do_bench`` median, ms) for a prototype's decode
    case, printed beside the bandwidth floor of its rows (``row_bytes`` each) and the goal (70% of the floor)."""
    from dsa.bench import mla_baseline, mla_baseline_chunk

    T, h_q = q.shape[0], q.shape[1]
    chunk = mla_baseline_chunk(idx.shape[1], h_q)
    ms = triton.testing.do_bench(lambda: mla_baseline(q, kv, idx, sm_scale, chunk), rep=100, return_mode="median")
    floor = T * idx.shape[1] * row_bytes / H200_COPY_BYTES_PER_S * 1e3
    print(f"T {T}: PyTorch baseline ({what}) {ms * 1e3:.1f} us; the bandwidth floor {floor * 1e3:.1f} us (the goal: "
          f"70% of it, {floor / 0.7 * 1e3:.1f})", flush=True)
    return ms


def merge_partials(o_part, lse_part, ml_part, attn_sink=None):
    """The library's split merge (``_sparse_mla_combine_kernel``) over a prototype's partials ``o_part`` [NS, T, h,
    512] f32, ``lse_part`` / ``ml_part`` [NS, T, h] (log2 units), with the sink ``attn_sink`` [h] f32 or None:
    ``(out [T, h, 512] bf16, max_logits, lse)``."""
    from dsa.mla.kernel import _sparse_mla_combine_kernel, combine_config

    ns, T, h_q, _ = o_part.shape
    out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device=o_part.device)
    ml = torch.empty(T, h_q, dtype=torch.float32, device=o_part.device)
    lse = torch.empty(T, h_q, dtype=torch.float32, device=o_part.device)
    mc = combine_config(T, h_q, ns, 512)
    _sparse_mla_combine_kernel[(T, triton.cdiv(h_q, mc["BLOCK_H"]), triton.cdiv(512, mc["DC"]))](
        o_part, lse_part, ml_part, lse if attn_sink is None else attn_sink, out, out.stride(0), out.stride(1), ml, lse,
        lse, T, h_q, ns, D=512, HAS_SINK=attn_sink is not None, **mc)
    return out, ml, lse


def _build_sm90(consts):
    return compile_sm90(_bulk_walk_kernel, consts, dict(kv_ptr="*i32", idx_ptr="*i32", out_ptr="*i32"), consts["CW"])


def _consts(row, stages, consume, lw=1, alt=0, math=0, cw=4, piece=None):
    piece = piece or row
    assert row % piece == 0 and piece % 16 == 0, (row, piece)
    return dict(ROW=row, STAGES=stages, CONSUME=consume, RING_OFF=0, BAR_OFF=0, LW=lw, ALT=alt, MATH=math, CW=cw,
                PIECE=piece, **ring_parts(row, stages))


def compile_only(row, stages, consume, lw=1, alt=0, math=0, cw=4, piece=None):
    """CPU: compile for sm_90, resolve the offsets, compile again; print what the kernel got."""
    consts = _consts(row, stages, consume, lw, alt, math, cw, piece)
    parts = ring_parts(row, stages)
    ring, bar = offsets(_build_sm90(consts).asm["ttgir"], parts, stages)
    consts.update(RING_OFF=ring, BAR_OFF=bar)
    k = _build_sm90(consts)
    assert offsets(k.asm["ttgir"], parts, stages) == (ring, bar)
    n_bulk = k.asm["ptx"].count("cp.async.bulk.shared")
    print(f"row {row} stages {stages} consume {consume} loader warps {lw} alt {alt} math {math} consumer warps {cw}, "
          f"piece {consts['PIECE']}: parts {parts}, ring at {ring}, full barriers at {bar}, shared "
          f"{k.metadata.shared} B, {n_bulk} bulk copies in the PTX", flush=True)
    return k


_OFFS = {}


def bulk_walk(words, idx, out, splits, stages, consume, lw=1, alt=0, math=0, cw=4, piece=None):
    """``words`` [S, W] int32 rows (contiguous, 16-byte aligned rows); ``idx`` [T, topk] int32; ``out`` [T, topk]
    int32 (each row's wrapping word sum when ``consume``). ``splits`` CTAs per index list; ``piece``: bytes per
    bulk copy (a divisor of the row's, a multiple of 16; None: the whole row)."""
    S, w = words.shape
    row = 4 * w
    assert row % 16 == 0 and words.data_ptr() % 16 == 0
    topk = idx.shape[1]
    chunk = triton.cdiv(triton.cdiv(topk, splits), BN.value) * BN.value
    grid = (triton.cdiv(topk, chunk), idx.shape[0])
    args = (words, idx, out, S, topk, chunk, idx.stride(0), out.stride(0))
    # with loaders on alternate tiles, each stage must have one loader (a parity wait tells only two phases apart)
    assert not alt or stages % lw == 0, "ALT 1 needs the stages to be a multiple of the loader warps"
    consts = _consts(row, stages, consume, lw, alt, math, cw, piece)
    parts = ring_parts(row, stages)
    key = tuple(consts.items())
    if key not in _OFFS:  # the offsets of the variant that runs, and of the same kernel compiled for sm_90 here
        k = _bulk_walk_kernel.warmup(*args, grid=grid, num_warps=cw, **consts)
        offs = offsets(k.asm["ttgir"], parts, stages)
        cc = torch.cuda.get_device_capability()
        assert cc == (9, 0) and offsets(_build_sm90(consts).asm["ttgir"], parts, stages) == offs, (cc, offs)
        _OFFS[key] = offs
    consts["RING_OFF"], consts["BAR_OFF"] = _OFFS[key]
    _bulk_walk_kernel[grid](*args, num_warps=cw, **consts)


#: per case: (tokens, row format, [(label, splits, stages, loader warps, alt, consumer modes, math, consumer warps)])
#: consumer modes: 0 waits, 1 reads (checked against the Triton walk when math is 0)
CASES = {
    # one CTA per SM with 1-4 tiles of rows in the ring (one partition of 2 loader warps), copied and read: how many
    # tiles in flight the copies need (a one-tile stage for the Hopper rows kernel's fp8 producers: 52nd session)
    "stages": [
        ("fp8 656 B, 64 tokens", 64, "fp8_ds_mla", [(2, st, 2, 0, (1, ), 0, 4) for st in (1, 2, 3, 4)]),
        ("fp8 656 B, 128 tokens", 128, "fp8_ds_mla", [(1, st, 2, 0, (1, ), 0, 4) for st in (1, 2, 4)]),
    ],
    # bf16 prefill's rows (4096 tokens x 2048 random slots of one 128K cache), as given and grouped by slot range:
    # what the copy engine gathers per SM, by whole rows and by 128-byte pieces (a swizzled tile by 128-byte tensor
    # copies takes 9 per row); one program per token, 1 CTA per SM (sixty-third session)
    "prefill": [
        (f"bf16 prefill{g}", 4096, "bf16",
         [(1, 2, 2, 0, (0, 1), 0, 4), (1, 3, 2, 0, (0, 1), 0, 4), (1, 3, 3, 1, (0, ), 0, 4),
          (1, 2, 2, 0, (0, ), 0, 4, 128), (1, 2, 2, 1, (0, ), 0, 4, 128), (1, 3, 3, 1, (0, 1), 0, 4, 128)],
         (1, 131072, bool(g))) for g in ("", " grouped")
    ],
    "call 1": [
        ("fp8 656 B, 64 tokens", 64, "fp8_ds_mla",
         [(2, st, 1, 0, (0, 1), 0, 4) for st in (2, 3, 4, 5)] + [(2, 3, 2, 0, (0, 1), 0, 4), (2, 4, 2, 0, (0, 1), 0, 4),
                                                               (4, 2, 1, 0, (0, 1), 0, 4), (4, 3, 1, 0, (0, 1), 0, 4)]),
        ("fp8 656 B, 128 tokens", 128, "fp8_ds_mla",
         [(1, st, 1, 0, (0, 1), 0, 4) for st in (3, 4, 5)] + [(2, 2, 1, 0, (0, 1), 0, 4)]),
        ("bf16 1152 B, 64 tokens", 64, "bf16", [(2, 2, 1, 0, (0, 1), 0, 4), (2, 3, 1, 0, (0, 1), 0, 4)]),
    ],
    "call 2": [
        ("fp8 656 B, 64 tokens", 64, "fp8_ds_mla",
         [(2, 4, 2, 0, (1, ), 0, 4), (2, 4, 2, 1, (0, 1), 0, 4), (2, 3, 3, 1, (0, 1), 0, 4),
          (2, 4, 4, 1, (0, 1), 0, 4), (2, 2, 2, 1, (1, ), 0, 4), (4, 2, 2, 1, (1, ), 0, 4), (2, 4, 4, 1, (1, ), 0, 8)]
         + [(2, 4, 4, 1, (1, ), m, cw) for m in (32, 64, 96) for cw in (4, 8)]),
        ("fp8 656 B, 32 tokens", 32, "fp8_ds_mla", [(4, 4, 4, 1, (1, ), 0, 4), (4, 4, 2, 1, (1, ), 0, 4)]),
        ("fp8 656 B, 128 tokens", 128, "fp8_ds_mla", [(1, 4, 2, 1, (1, ), 0, 4), (1, 4, 4, 1, (1, ), 0, 4)]),
        ("bf16 1152 B, 32 tokens", 32, "bf16", [(4, 2, 1, 0, (1, ), 0, 4), (4, 2, 2, 1, (1, ), 0, 4)]),
        ("bf16 1152 B, 64 tokens", 64, "bf16", [(2, 2, 2, 1, (0, 1), 0, 4), (2, 3, 3, 1, (1, ), 0, 4)]),
    ],
}


def main(which):
    from dsa.bench import mla_inputs
    from gather_ceiling import rows_sum

    dev = "cuda"
    ms_of = lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")  # noqa: E731
    table = []
    for name, T, fmt, configs, *where in CASES[which]:
        nreq, s_kv, grouped = where[0] if where else (T, 32768, False)
        _, kv, idx = mla_inputs(T, 16, 2048, nreq, s_kv, fmt, dev=dev)
        words = kv.reshape(-1, kv.shape[-1]).view(torch.int32)
        if grouped:  # the lists as sparse_mla takes them for many tokens over a large cache (dsa.mla.order)
            from dsa.mla.order import order_indices

            idx = order_indices(idx, words.shape[0])
        nbytes = float(T * 2048 * words.shape[1] * 4)
        ref = torch.empty(T, 2048, dtype=torch.int32, device=dev)
        rows_sum(words, idx, ref, 32, 16, 3, 8)
        valid = (idx >= 0) & (idx < words.shape[0])
        ms = ms_of(lambda: rows_sum(words, idx, ref, 32, 16, 3, 8))
        table.append((name, "walk (Triton loads): 16 splits, 8 warps, tile 32", ms, nbytes))
        for splits, stages, lw, alt, modes, math, cw, *piece in configs:
            piece = piece[0] if piece else None
            for consume in modes:
                out = torch.full((T, 2048), -7, dtype=torch.int32, device=dev)
                label = (f"{splits} sp, {stages} st, {lw} ldr{' alt' if alt else ''}, {cw} cons "
                         + ("reads" if consume else "waits") + (f" + {math * BN.value // 2} FMA clk" if math else "")
                         + (f", {piece} B copies" if piece else ""))
                try:
                    bulk_walk(words, idx, out, splits, stages, consume, lw, alt, math, cw, piece)
                    torch.cuda.synchronize()
                    if consume:
                        bad = int(((out != ref) & valid).sum())
                        assert bad == 0, f"{bad} of {int(valid.sum())} row sums differ from the walk's"
                    ms = ms_of(lambda: bulk_walk(words, idx, out, splits, stages, consume, lw, alt, math, cw, piece))
                except Exception as e:  # report and go on
                    print(f"  {name}, {label}: {type(e).__name__}: {e}"[:300], flush=True)
                    continue
                table.append((name, label, ms, nbytes))
                print(f"  {name}, {label}: {ms * 1e3:.1f} us", flush=True)
    print(f"\n{'rows':<22} {'kernel':<52} {'us':>7} {'GB/s':>6} {'% copy':>6}")
    for name, kern, ms, nbytes in table:
        gbs = nbytes / ms / 1e6
        print(f"{name:<22} {kern:<52} {ms * 1e3:7.1f} {gbs:6.0f} {100 * gbs * 1e9 / H200_COPY_BYTES_PER_S:5.1f}%")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="?", default="call 2", choices=sorted(CASES), help="the set of cases to run")
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args()
    if a.compile_only:
        for args in ((656, 2, 0), (656, 4, 1), (656, 4, 0, 2), (1152, 3, 1), (656, 4, 1, 4, 1, 64, 8),
                     (656, 3, 1, 3, 1), (1152, 3, 1, 3, 1, 0, 4, 128), (1152, 2, 0, 2, 0, 0, 4, 128)):
            compile_only(*args)
    else:
        main(a.which)
