"""Decode indexer logits on Hopper (sm_90), written in Gluon: ``fp8_paged_mqa_logits`` with the
paged cache copied by TMA, several tiles in flight.

Why a second kernel: the portable Triton kernel (:mod:`dsa.mqa_logits.kernel`) issues its key copies
as ``cp.async`` through the pipeliner (or loads by hand), and its loop carries the block-table
indirection per tile; at block size 64 it stops near 3.3 TB/s with next_n 1 and 2.1-2.3 TB/s with
next_n 2 (BENCHMARKS.md, "Decode logits sweeps"). Here:

* One program = one request x a span of ``SPAN`` positions; one warpgroup (two when the product's
  N = ``next_power_of_2(next_n) * H`` exceeds 128: each takes half of the (row, head) columns);
  several programs per SM (about 50 KiB of shared memory at next_n 2, 64 heads).
* Every 64-key tile is copied by TMA straight from the paged cache into shared memory, ``STAGES``
  tiles in flight, one mbarrier per buffer: the keys as 128-byte rows of the cache (a block of
  ``bs`` keys is ``bs * 33 / 32`` such rows: its ``bs`` value rows, then its scales), the tile's 64
  fp32 scales by a second, one-dimensional descriptor. A block-table entry outside
  ``[0, num_blocks)`` gets coordinates past the end of the cache: the TMA reads nothing and writes
  zeros (its logits are 0, as in the Triton kernel). Block-table entries are loaded one tile before
  the copy they address.
* Below 32 keys per block (a block is not a whole number of 128-byte rows) the keys and scales are copied by
  ``cp.async`` instead, the same ``STAGES`` ring with one commit group per tile. Each key's offset is formed once,
  one key per lane, and spread to the copy layout inside the warp (:func:`_cp_layouts`); its scale is copied in the
  same group. Against forming the offsets in the copy layout and loading the scales into registers one tile ahead:
  2-15% faster at blocks 1, 2, 4 and 16 (BENCHMARKS.md, twenty-first session).
* Per tile ONE product ``wgmma(keys [64, 128], q^T [128, NP*H])`` in fp8 with fp32 accumulation (the
  request's next_n rows share the key tile, padding rows are zero), then relu x head weight, reshaped
  ``[64, NP, H]`` (no data movement) and summed over the heads in registers and across 4 lanes, times
  the key scales. Positions at or past the request's context (whose cache slots may hold NaN: the
  copies take whole 64-key tiles of a block) are replaced, never multiplied; -inf past each row's own
  limit (``clean_logits``).

Measured and not kept (BENCHMARKS.md): one product per query row with row j + 1's issued while row j
is reduced, and the same with the next tile's first product issued before the last reduction; a persistent
grid (one program per resident CTA, each an equal share of all requests' tiles and -inf chunks): no faster at
next_n 2, 6% slower at next_n 1; per-stage buffers and mbarriers with the loop unrolled by the stages (2 CTA-wide
barriers per tile instead of 4: 3-9% slower); a persistent warp-specialised kernel (a loader warp, two product
warpgroups on alternate tiles, one CTA per SM: 15-33% slower). For block size 1 (keys only 4-byte aligned, so
their ``cp.async`` pieces are 4 bytes and go through L1): each key's 16-byte-aligned bytes copied by 16-byte
``cp.async.cg`` (around L1) into a staging buffer and shifted into place in shared memory (1.35-2.9x slower), the
keys loaded by hand one tile ahead into registers (``ld.global.cg``: 19-39% slower), a larger shared-memory
carveout (less L1: 5-23% slower at the largest), more tiles in flight per CTA (3 stages: 10-26% slower with the
L1 their shared memory leaves, 8-13% with the carveout kept at 58% and so fewer CTAs), a cap of 80 registers (six
CTAs per SM instead of five: no change), a key not read marked by a negative offset tested on its high word alone
(17% fewer tile-loop instructions with the compact copies: no change).

Served: every block size the op accepts (TMA copies for multiples of 32, a block being a whole number of 128-byte rows;
``cp.async`` below), a cache whose rows are contiguous and start on a 16-byte boundary and, with TMA, that is
under 8 GiB (TMA coordinates are int32 and the scales' descriptor counts 4-byte elements); everything else runs
the Triton kernel, which also stays the path under the CPU interpreter (Gluon kernels do not run there:
this one is tested on the GPU against the reference and the Triton kernel, tests/test_mqa_logits.py,
``test_gpu_paged_sm90*``).
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..constants import INDEXER_HEAD_DIM, INDEXER_ROW_BYTES

BLOCK_N = 64  # keys per tile
# shared-memory layouts of a tile's keys (128-byte rows, the product's A operand) and scales, and of the TMA copies
_KEYS_SH = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
_SCALES_SH = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1))


def default_config(block_size: int, next_n: int) -> dict:
    """Launch configuration: ``SPAN`` positions per program, ``STAGES`` tiles in flight (optional ``WGS``
    warpgroups, ``MAXNREG`` register cap). Chosen on the H200 (BENCHMARKS.md, B = 64, 32K-128K contexts):
    the cp.async copies of small blocks do best with fewer tiles in flight (block 1, next_n 2: 2 stages
    0.387 ms, 3 stages 0.406, 4 stages 0.485; block 4: 3 stages 0.316, 4 stages 0.339). Block 1, next_n 1: the
    Gluon kernel at 0.318 ms shuffled, 0.267 in slot order, against 0.333 / 0.287 for the Triton kernel (twentieth
    session; 0.285 / 0.239 since the compact copies). next_n 2 with the register cap 0.375 / 0.341 against 0.384 /
    0.346 without (block 2: no change, so 128 applies there too; blocks 4 and 16 within 1%, uncapped). Twenty-second
    session: block 1 next_n 1 capped at 64 registers spills and is 31-39% slower, at 72 unchanged; block 4 next_n 2
    with a cap of 128 or 2 stages 1-3% faster, inside the default's own 9% spread between rounds: left as is."""
    if block_size < 4 and next_n == 2:
        # 128 registers let four CTAs share an SM instead of three (the copies of the twentieth session took 168
        # uncapped; the compact copies take 128 either way, and the cap stays as a bound)
        return dict(SPAN=2048, STAGES=2, MAXNREG=128)
    if block_size < 4:
        return dict(SPAN=2048, STAGES=2)
    if next_n == 1:
        return dict(SPAN=1024, STAGES=4)
    return dict(SPAN=2048, STAGES=3 if block_size < 32 else 4)


_MAX_CACHE_BYTES = 1 << 33  # the scales' descriptor: coordinates (4-byte elements) must stay int32


@gluon.jit
def _phys(bt_row, s0, c_hi, max_blocks, c: gl.constexpr, BS: gl.constexpr, KB: gl.constexpr):
    """Physical block of chunk ``c`` (``KB`` keys) of the tile starting at ``s0`` (-1: not read)."""
    s = s0 + c * KB
    blk = s // BS
    return gl.load(bt_row + blk, mask=(s < c_hi) & (blk < max_blocks), other=-1)


@gluon.jit
def _issue(k_desc, s_desc, k_buf, s_buf, bar, p0, p1, s0, pred, num_blocks, rows_total, floats_total,
           BS: gl.constexpr, KB: gl.constexpr, CH: gl.constexpr):
    """TMA copies of one tile (keys and scales, ``CH`` chunks of ``KB`` keys) into one buffer, signalled
    on ``bar``; nothing is issued unless ``pred``."""
    mbarrier.expect(bar, 64 * 128 + 64 * 4, pred=pred)
    o = s0 % BS  # the tile's first key inside its block (0 unless BS > 64)
    _issue_chunk(k_desc, s_desc, k_buf, s_buf, bar, p0, o, 0, pred, num_blocks, rows_total, floats_total, BS, KB)
    if CH == 2:
        _issue_chunk(k_desc, s_desc, k_buf, s_buf, bar, p1, o, 1, pred, num_blocks, rows_total, floats_total, BS,
                     KB)


@gluon.jit
def _issue_chunk(k_desc, s_desc, k_buf, s_buf, bar, p, o, c: gl.constexpr, pred, num_blocks, rows_total,
                 floats_total, BS: gl.constexpr, KB: gl.constexpr):
    ok = (p >= 0) & (p < num_blocks)
    # an invalid entry gets coordinates past the end: the TMA reads nothing and fills zeros
    row = gl.where(ok, p * (BS * 33 // 32) + o, rows_total)
    f = gl.where(ok, p * (BS * 33) + BS * 32 + o, floats_total)
    tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_buf.slice(c * KB, KB, dim=0), pred=pred)
    tma.async_copy_global_to_shared(s_desc, [f], bar, s_buf.slice(c * KB, KB), pred=pred)


@gluon.jit
def _phys_keys(bt_row, s0, c_hi, max_blocks, BS: gl.constexpr, layout: gl.constexpr):
    """Physical block of each key of the tile starting at ``s0`` (-1 past ``c_hi``: not read)."""
    s = s0 + gl.arange(0, 64, layout)
    blk = s // BS
    return gl.load(bt_row + blk, mask=(s < c_hi) & (blk < max_blocks), other=-1)


@gluon.jit
def _issue_cp(k_buf, s_buf, kv_ptr, kv32_ptr, phys, s0, num_blocks, BS: gl.constexpr, VEC: gl.constexpr,
              kc_l: gl.constexpr, cp_l: gl.constexpr):
    """cp.async of one tile's keys in ``VEC``-byte pieces, committed as one group (empty past the last tile). Each
    key's byte offset is formed once (``phys`` from :func:`_phys_keys` in the compact layout ``kc_l``, one key per
    lane) and spread to the copy layout ``cp_l`` inside each warp. A key in a block outside the cache or at or past
    ``c_hi`` (``phys`` -1) is zero-filled, never read. The keys' fp32 scales go into ``s_buf`` by the same group (0
    where not read)."""
    s = s0 + gl.arange(0, 64, kc_l)
    ok = (phys >= 0) & (phys < num_blocks)
    pc = gl.where(ok, phys, 0).to(gl.int64)
    base = gl.convert_layout(gl.where(ok, pc * (BS * 132) + (s % BS) * 128, -1), gl.SliceLayout(1, cp_l))
    okc = base >= 0
    cols = gl.arange(0, 128, gl.SliceLayout(0, cp_l))
    cp.async_copy_global_to_shared(k_buf, kv_ptr + gl.multiple_of(gl.where(okc, base, 0), VEC)[:, None]
                                   + cols[None, :], mask=okc[:, None])
    cp.async_copy_global_to_shared(s_buf, kv32_ptr + pc * (BS * 33) + BS * 32 + s % BS, mask=ok)
    cp.commit_group()


@gluon.jit(do_not_specialize=["num_blocks", "max_blocks", "max_context_len", "rows_total", "floats_total"])
def _paged_logits_sm90_kernel(
    k_desc, s_desc,  # TMA descriptors: the cache as [rows_total, 128] fp8 rows and as [floats_total] fp32
    kv_ptr, kv32_ptr,  # the cache as fp8 and as fp32 (without TMA: block sizes below 32)
    q_ptr, stride_qb, stride_qn, stride_qh,  # [B, next_n, H, 128] fp8
    w_ptr, stride_wm,  # [B*next_n, H] f32
    ctx_ptr, stride_cb,  # [B] or [B, next_n] int32
    bt_ptr, stride_btb,  # [B, max_blocks] int32
    out_ptr, stride_om,  # [B*next_n, max_context_len] f32
    num_blocks, max_blocks, max_context_len, rows_total, floats_total,
    NEXT_N: gl.constexpr, NP: gl.constexpr, CTX_2D: gl.constexpr, H: gl.constexpr, BS: gl.constexpr,
    SPAN: gl.constexpr, STAGES: gl.constexpr, WGS: gl.constexpr, CLEAN: gl.constexpr,
    VEC: gl.constexpr, CP_L: gl.constexpr, KC_L: gl.constexpr,  # without TMA: the copies (_cp_layouts)
):
    BN: gl.constexpr = 64
    D: gl.constexpr = 128
    TMA: gl.constexpr = BS % 32 == 0  # a block is a whole number of 128-byte rows
    KB: gl.constexpr = BS if BS < BN else BN  # keys per TMA copy (one block or one tile)
    CH: gl.constexpr = BN // KB if TMA else 1  # TMA copies per tile (1, or 2 for 32-key blocks)
    cp_l: gl.constexpr = CP_L
    kc_l: gl.constexpr = KC_L
    R: gl.constexpr = NP * H  # the product's N: (row, head) pairs, row-major

    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WGS],
                                                    instr_shape=[16, R // WGS, 32])
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    ld_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4 * WGS, 1], [1, 0])
    fill_l: gl.constexpr = gl.BlockedLayout([4], [32], [4 * WGS], [0])
    k_sh: gl.constexpr = _KEYS_SH
    s_sh: gl.constexpr = _SCALES_SH
    zero = gl.zeros([BN, R], gl.float32, acc_l)
    # the layout of the per-(key, row) logits: the head sum of the product, reshaped [BN, NP, H] (no data
    # movement: each warpgroup's rows stay in its registers), reduced in registers and across 4 lanes
    v_l: gl.constexpr = gl.sum(gl.reshape(zero, [BN, NP, H]), axis=2).type.layout
    key_l: gl.constexpr = gl.SliceLayout(1, v_l)
    row_l: gl.constexpr = gl.SliceLayout(0, v_l)

    pid_s = gl.program_id(0)
    b = gl.program_id(1)
    b64 = b.to(gl.int64)

    # each row's key limit (SPEC) and head weights; padding rows (j >= next_n) have limit 0 and weight 0
    jj = gl.arange(0, NP, row_l)
    j_ok = jj < NEXT_N
    if CTX_2D:
        lim = gl.load(ctx_ptr + b64 * stride_cb + jj, mask=j_ok, other=0)
    else:
        lim = gl.load(ctx_ptr + b64 * stride_cb) - NEXT_N + jj + 1
    lim = gl.where(j_ok, gl.minimum(gl.maximum(lim, 0), max_context_len), 0)
    lmax = gl.max(lim, axis=0)
    out_rows = out_ptr + (b64 * NEXT_N + jj) * stride_om
    offs_c = gl.arange(0, R, col_l)
    w = gl.load(w_ptr + (b64 * NEXT_N + offs_c // H) * stride_wm + offs_c % H, mask=offs_c // H < NEXT_N, other=0.0)

    s_lo = pid_s * SPAN
    s_hi = gl.minimum(max_context_len, s_lo + SPAN)
    c_hi = gl.maximum(gl.minimum(s_hi, lmax), s_lo)
    n_tiles = gl.cdiv(c_hi - s_lo, BN)
    c_end = s_lo + n_tiles * BN

    if CLEAN:  # positions past every row's limit, inside the span: -inf
        for s0 in range(c_end, s_hi, 512):
            offs = s0 + gl.arange(0, 512, fill_l)
            ninf = gl.full([512], float("-inf"), gl.float32, fill_l)
            for j in gl.static_range(NEXT_N):
                gl.store(out_ptr + (b64 * NEXT_N + j) * stride_om + offs, ninf, mask=offs < s_hi)

    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, D], k_sh)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BN], s_sh)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [R, D], k_sh)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for t in gl.static_range(STAGES):
        mbarrier.init(bars.index(t), count=1)

    # the first STAGES - 1 tiles' copies, then q (plain loads into shared memory) while they fly
    bt_row = bt_ptr + b64 * stride_btb
    n0 = s_lo + (STAGES - 1) * BN
    if TMA:
        for t in gl.static_range(STAGES - 1):
            s0 = s_lo + t * BN
            p0 = _phys(bt_row, s0, c_hi, max_blocks, 0, BS, KB)
            p1 = _phys(bt_row, s0, c_hi, max_blocks, CH - 1, BS, KB)
            _issue(k_desc, s_desc, k_smem.index(t), s_smem.index(t), bars.index(t), p0, p1, s0, t < n_tiles,
                   num_blocks, rows_total, floats_total, BS, KB, CH)
        p0 = _phys(bt_row, n0, c_hi, max_blocks, 0, BS, KB)
        p1 = _phys(bt_row, n0, c_hi, max_blocks, CH - 1, BS, KB)
    else:
        for t in gl.static_range(STAGES - 1):
            s0 = s_lo + t * BN
            _issue_cp(k_smem.index(t), s_smem.index(t), kv_ptr, kv32_ptr,
                      _phys_keys(bt_row, s0, c_hi, max_blocks, BS, kc_l), s0, num_blocks, BS, VEC, kc_l, cp_l)
        p0 = _phys_keys(bt_row, n0, c_hi, max_blocks, BS, kc_l)

    offs_qr = gl.arange(0, R, gl.SliceLayout(1, ld_l))
    offs_qd = gl.arange(0, D, gl.SliceLayout(0, ld_l))
    q_off = b64 * stride_qb + (offs_qr // H) * stride_qn + (offs_qr % H) * stride_qh
    q_smem.store(gl.load(q_ptr + q_off[:, None] + offs_qd[None, :], mask=(offs_qr // H < NEXT_N)[:, None], other=0.0))
    fence_async_shared()

    for i in range(n_tiles):
        t_n = i + STAGES - 1
        slot_n = t_n % STAGES
        s_n = s_lo + t_n * BN
        slot = i % STAGES
        if TMA:
            # every warp is done with tile i - 1 (its product and scales): its buffer takes tile i + STAGES - 1
            gl.thread_barrier()
            _issue(k_desc, s_desc, k_smem.index(slot_n), s_smem.index(slot_n), bars.index(slot_n), p0, p1, s_n,
                   t_n < n_tiles, num_blocks, rows_total, floats_total, BS, KB, CH)
            p0 = _phys(bt_row, s_n + BN, c_hi, max_blocks, 0, BS, KB)
            p1 = _phys(bt_row, s_n + BN, c_hi, max_blocks, CH - 1, BS, KB)
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        else:
            # this thread's copies of tile i are in; after the barrier everyone's are (and every warp is
            # done with tile i - 1, whose buffer takes tile i + STAGES - 1)
            cp.wait_group(STAGES - 2)
            fence_async_shared()
            gl.thread_barrier()
            _issue_cp(k_smem.index(slot_n), s_smem.index(slot_n), kv_ptr, kv32_ptr, p0, s_n, num_blocks, BS, VEC,
                      kc_l, cp_l)
            p0 = _phys_keys(bt_row, s_n + BN, c_hi, max_blocks, BS, kc_l)
        scale = s_smem.index(slot).load(key_l)
        acc = warpgroup_mma(k_smem.index(slot), q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        offs = s_lo + i * BN + gl.arange(0, BN, key_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        v = gl.sum(gl.reshape(gl.maximum(acc, 0.0) * w[None, :], [BN, NP, H]), axis=2)
        # slots at or past the context may hold NaN: replaced, never multiplied
        v = gl.where((offs < c_hi)[:, None], v * scale[:, None], 0.0)
        if CLEAN:
            v = gl.where(offs[:, None] < lim[None, :], v, float("-inf"))
        gl.store(out_rows[None, :] + offs[:, None], v, mask=(offs < s_hi)[:, None] & j_ok[None, :])
    if not TMA:
        cp.wait_group(0)  # the empty groups past the last tile
    for t in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(t))


@functools.lru_cache(maxsize=None)
def _cp_layouts(bs: int, wgs: int):
    """Without TMA (block sizes below 32): ``(VEC, copy layout, compact key layout)``. The keys are copied by
    cp.async in ``VEC``-byte pieces, as wide as their alignment allows (a block is ``bs * 132`` bytes). A warp's
    copy covers one key of 32 4-byte pieces (block 1), else 4 keys x 8 pieces. (4 keys x 8 pieces for block 1 too:
    4-10% faster with keys in slot order, 11-35% slower with the benchmark's shuffled table; block 2 with 4 keys
    instead of 2: 10-12% faster. H200, BENCHMARKS.md nineteenth and twentieth sessions.)

    The compact layout holds a tile's 64 block-table entries and key offsets, one key per lane (the rest
    broadcast), each warp the keys its copies take: each offset is formed once and spread to the copy layout inside
    the warp (blocks 1-16: up to 11% faster than forming it in the copy layout, twenty-first session)."""
    vec = 16 if bs % 4 == 0 else 4 * bs
    per_copy = 1 if bs == 1 else 4  # keys side by side in one warp's copy
    nw = 4 * wgs
    cp_l = gl.BlockedLayout([1, vec], [per_copy, 32 // per_copy], [nw, 1], [1, 0])
    bits = [[1 << b] for b in range(6)]  # key bits: per_copy's lanes, then the warps, then the copy's repeats
    lb, wb = per_copy.bit_length() - 1, nw.bit_length() - 1
    lane = bits[:lb] + bits[lb + wb:]
    kc_l = gl.DistributedLinearLayout(reg_bases=[], lane_bases=lane + [[0]] * (5 - len(lane)),
                                      warp_bases=bits[lb:lb + wb], block_bases=[], shape=[64])
    return vec, cp_l, kc_l


def supported(q: torch.Tensor, cache_blocks: torch.Tensor) -> bool:
    """Whether this kernel serves the call (arguments already validated): an NVIDIA Hopper GPU
    (:func:`dsa.backend.on_hopper`: not ROCm, not under the Triton interpreter), the canonical
    ``[num_blocks, bs*132]`` cache view with contiguous rows starting on a 16-byte boundary; with a block size that
    is a multiple of 32 (TMA) the cache must also be under 8 GiB."""
    from ..backend import on_hopper

    if not on_hopper(q.device):
        return False
    num_blocks, row = cache_blocks.shape
    bs = row // INDEXER_ROW_BYTES
    if cache_blocks.stride(1) != 1 or cache_blocks.stride(0) != row or cache_blocks.data_ptr() % 16:
        return False
    if bs % 32 == 0 and num_blocks * row >= _MAX_CACHE_BYTES:
        return False
    return True


def launch(q, cache_blocks, weights, context_lens, block_table, max_context_len, clean_logits, out, config=None):
    """Launch on validated arguments where :func:`supported` (called by
    :func:`dsa.mqa_logits.kernel.fp8_paged_mqa_logits_triton`)."""
    B, next_n, H, D = q.shape
    assert D == INDEXER_HEAD_DIM and q.stride(3) == 1 and weights.stride(1) == 1
    num_blocks, row = cache_blocks.shape
    bs = row // INDEXER_ROW_BYTES
    cfg = default_config(bs, next_n)
    cfg.update(config or {})
    opts = {} if cfg.get("MAXNREG") is None else dict(maxnreg=int(cfg["MAXNREG"]))
    flat = cache_blocks.reshape(-1)
    rows_total = flat.numel() // 128
    floats_total = flat.numel() // 4
    kv = flat.view(torch.float8_e4m3fn)
    keys = kv[:rows_total * 128].view(rows_total, 128)
    scales = flat.view(torch.float32)
    k_desc = s_desc = None
    if bs % 32 == 0:
        kb = min(bs, BLOCK_N)
        k_desc = TensorDescriptor(keys, [rows_total, 128], [128, 1], [kb, 128], _KEYS_SH.value)
        s_desc = TensorDescriptor(scales, [floats_total], [1], [kb], _SCALES_SH.value)
    span = max(BLOCK_N, cfg["SPAN"] // BLOCK_N * BLOCK_N)
    np_ = 1 << (next_n - 1).bit_length()
    # warpgroups splitting the (row, head) columns: one while its accumulator fits (N <= 128), else two
    wgs = int(cfg.get("WGS", 1 if np_ * H <= 128 else 2))
    grid = ((max_context_len + span - 1) // span, B)
    vec, cp_l, kc_l = _cp_layouts(bs, wgs)
    _paged_logits_sm90_kernel[grid](
        k_desc, s_desc, kv, scales, q, q.stride(0), q.stride(1), q.stride(2), weights, weights.stride(0), context_lens,
        context_lens.stride(0), block_table, block_table.stride(0), out, out.stride(0),
        num_blocks, block_table.shape[1], max_context_len, rows_total, floats_total,
        NEXT_N=next_n, NP=np_, CTX_2D=context_lens.dim() == 2, H=H, BS=bs, SPAN=span, STAGES=int(cfg["STAGES"]),
        WGS=wgs, CLEAN=bool(clean_logits), VEC=vec, CP_L=cp_l, KC_L=kc_l,
        num_warps=4 * wgs, **opts)
    return out
