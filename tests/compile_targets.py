"""Compile (never launch) every portable Triton kernel that ``dsa``'s ops reach, for a GPU this machine does not have.

    python tests/compile_targets.py 80        # NVIDIA compute capability 8.0 (A100); also 86, 89, 90, 100, 120
    python tests/compile_targets.py gfx942    # AMD MI300 (gfx942); also gfx90a, gfx950
    python tests/compile_targets.py gfx942 --search-mla   # the target's entries of dsa.mla.kernel.TARGET_CONFIGS

Run without ``TRITON_INTERPRET``. A stand-in Triton driver reports the target, every launch only compiles, and a
kernel that needs more shared memory than the target's GPUs offer raises Triton's ``OutOfResources``, as the real
launch would. The library is told the same facts about the device (:mod:`dsa.backend`: NVIDIA or not, e4m3fn in
Triton or not, the target). Then one call of every public op per variant (formats, block sizes, head counts, split
or not) runs on small CPU tensors with ``backend="triton"``. Prints one line per op and a JSON summary last (with
each kernel's shared memory and spilled registers); exits 1 if any op failed. ``tests/test_targets.py`` runs it
for the targets of CI. ``--search-mla`` instead tries sparse-MLA configurations near the H200's
(:func:`search_mla_configs`) and prints the first that fits and does not spill, per case.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

#: shared memory per block (opt-in maximum) of each target's GPUs, bytes
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376, 121: 101376,
                "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}


class _Driver:
    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


#: spill bytes (:func:`spill_bytes`) a kernel may have and still count as not spilling: a few registers stored once
#: outside the main loop, as in the H200's own measured configurations (64-head bf16 programs: 16 bytes on sm_90)
SPILL_OK = 32


def spill_bytes(kernel) -> int:
    """Bytes per thread a compiled kernel keeps in local (NVIDIA) or scratch (AMD) memory: registers spilled, as
    the compiler reports them (``cuobjdump -res-usage``'s STACK; the AMDGPU metadata's private segment size)."""
    if "amdgcn" in kernel.asm:
        return int(re.search(r"\.private_segment_fixed_size:\s+(\d+)", kernel.asm["amdgcn"]).group(1))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        res = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True)
    return int(re.search(r"STACK:(\d+)", res.stdout).group(1))


def install(arg: str) -> dict:
    """Make this process compile for target ``arg`` and launch nothing: a stand-in Triton driver, every launch only
    compiling (``OutOfResources`` past the target's shared memory), and :mod:`dsa.backend` told the target's facts.
    Returns the record of what was launched: ``kernels`` (name -> the largest shared memory of its variants that
    fit), ``spills`` (name -> the most bytes of :func:`spill_bytes` among them), ``last`` (name -> the last such
    variant's spill bytes) and the target's facts."""
    key = arg if arg.startswith("gfx") else int(arg)
    target = GPUTarget("hip", arg, 64) if arg.startswith("gfx") else GPUTarget("cuda", key, 32)
    limit = SHARED_LIMIT[key]
    driver.set_active(_Driver(target))
    record = dict(kernels={}, spills={}, last={}, limit=limit, target=target)
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        shared = k.metadata.shared
        if shared > limit:
            raise OutOfResources(shared, limit, "shared memory")
        name = self.fn.__name__
        spilled = spill_bytes(k)
        record["kernels"][name] = max(record["kernels"].get(name, 0), shared)
        record["spills"][name] = max(record["spills"].get(name, 0), spilled)
        record["last"][name] = spilled
        return k

    jit.JITFunction.run = compile_only

    import dsa  # noqa: F401
    from dsa import backend

    nvidia = target.backend == "cuda"
    fp8 = backend._arch_has_e4m3(key) if nvidia else True
    fakes = {
        "triton_runs_on": lambda device: True,
        "on_hopper": lambda device: False,
        "compiled_nvidia": lambda device: nvidia,
        "nvidia_options": lambda device, **o: {k: v for k, v in o.items() if v is not None} if nvidia else {},
        "fp8_native": lambda device: fp8,
        "num_sms": lambda device: 108,
        "gpu_target": lambda device: (target.backend, target.arch),
    }
    originals = {name: getattr(backend, name) for name in fakes}
    for mod in [m for name, m in sys.modules.items() if name == "dsa" or name.startswith("dsa.")]:
        for name, fake in fakes.items():
            if getattr(mod, name, None) is originals[name]:
                setattr(mod, name, fake)
    record["fp8_native"] = fp8
    return record


def main(arg: str) -> int:
    record = install(arg)
    import dsa

    torch.manual_seed(0)
    f8, bf, i32 = torch.float8_e4m3fn, torch.bfloat16, torch.int32
    T = "triton"

    def indexer_cache():
        for bs in (1, 64):
            cache = torch.zeros(8, bs * 132, dtype=torch.uint8)
            dsa.indexer_k_quant_and_cache(torch.randn(5, 128).to(bf), cache, torch.arange(5), backend=T)
        dsa.indexer_k_quant(torch.randn(5, 128).to(bf), "ue8m0", backend=T)
        dsa.gather_indexer_k(torch.zeros(8, 64 * 132, dtype=torch.uint8), torch.arange(8, dtype=i32).view(2, 4),
                             torch.tensor([0, 100, 200], dtype=i32), backend=T)

    def indexer_prep():
        n = 4
        cos, sin = torch.randn(n, 32), torch.randn(n, 32)
        for had in (False, True):
            dsa.prepare_indexer_q(torch.randn(n, 64, 128).to(bf), cos, sin, torch.randn(n, 64), hadamard=had, backend=T)
            dsa.prepare_indexer_k(torch.randn(n, 128).to(bf), cos, sin, hadamard=had, backend=T)

    def mqa_logits():
        m, n = 64, 512
        dsa.fp8_mqa_logits(torch.randn(m, 64, 128).to(f8), (torch.randn(n, 128).to(f8), torch.rand(n)),
                           torch.randn(m, 64), torch.zeros(m, dtype=i32), torch.full((m,), n, dtype=i32), backend=T)

    def paged_mqa_logits():
        for bs in (1, 16, 64):
            for next_n in (1, 2):
                b, length = 3, 300
                nb = (length + bs - 1) // bs
                dsa.fp8_paged_mqa_logits(torch.randn(b, next_n, 64, 128).to(f8),
                                         torch.zeros(b * nb + 1, bs * 132, dtype=torch.uint8),
                                         torch.randn(b * next_n, 64), torch.full((b,), length, dtype=i32),
                                         torch.arange(b * nb, dtype=i32).view(b, nb), length, backend=T)

    def top_k():
        x = torch.randn(8, 5000)
        for k in (64, 2048):
            dsa.top_k_indices(x, k, torch.zeros(8, dtype=i32), torch.full((8,), 5000, dtype=i32), backend=T)
        lens = torch.full((8,), 5000, dtype=i32)
        dsa.top_k_indices(x, 64, seq_lens=lens, next_n=1, backend=T)
        dsa.top_k_indices(x, 64, seq_lens=lens, next_n=1, block_table=torch.arange(640, dtype=i32).view(8, 80),
                          block_size=64, backend=T)
        dsa.top_k_indices(torch.randn(2, 140000), 2048, seq_lens=torch.full((2,), 140000, dtype=i32), next_n=1,
                          backend=T)

    def metadata():
        dsa.convert_req_index_to_global_index(torch.tensor([0, 1, 2], dtype=i32), torch.arange(12, dtype=i32).view(3, 4),
                                              torch.randint(0, 200, (3, 64), dtype=i32), 64, backend=T)
        dsa.generate_sparse_seqlen(torch.tensor([0, 2, 5], dtype=i32), torch.tensor([10, 20], dtype=i32), 8, backend=T)

    def mla_cache():
        for fmt, row, dt in (("bf16", 576, bf), ("fp8_ds_mla", 656, torch.uint8)):
            dsa.concat_and_cache_mla(torch.randn(5, 512).to(bf), torch.randn(5, 64).to(bf),
                                     torch.zeros(4, 64, row, dtype=dt), torch.arange(5), kv_format=fmt, backend=T)
        dsa.dequantize_fp8_ds_mla(torch.zeros(5, 656, dtype=torch.uint8), backend=T)

    def sparse_mla():
        s = 4096
        for fmt in ("bf16", "fp8_ds_mla"):
            kv = torch.randn(s, 576).to(bf) if fmt == "bf16" else torch.zeros(s, 656, dtype=torch.uint8)
            for h in (16, 32, 64, 128):
                for t in (1, 300):  # split-K with the merge kernel, and one split
                    dsa.sparse_mla(torch.randn(t, h, 576).to(bf), kv, torch.randint(0, s, (t, 2048), dtype=i32), 0.1,
                                   backend=T)

    def sampling():
        from dsa.sampling import sample_tokens

        for dt in (torch.float32, bf):
            for top_p in (1.0, 0.9):
                sample_tokens(torch.randn(2, 129280).to(dt), torch.tensor([1, 2]), 0.8, top_p, backend=T)

    ops = dict(indexer_cache=indexer_cache, indexer_prep=indexer_prep, mqa_logits=mqa_logits,
               paged_mqa_logits=paged_mqa_logits, top_k=top_k, metadata=metadata, mla_cache=mla_cache,
               sparse_mla=sparse_mla, sampling=sampling)
    failed = {}
    for name, fn in ops.items():
        try:
            fn()
            print(f"ok    {name}", flush=True)
        except Exception as e:  # report every op, then fail
            lines = str(e).strip().splitlines()
            failed[name] = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
            print(f"FAIL  {name}: {failed[name]}", flush=True)
    print(json.dumps(dict(target=arg, fp8_native=record["fp8_native"], shared_limit=record["limit"], failed=failed,
                          kernels=record["kernels"], spills=record["spills"])))
    return 1 if failed else 0


def mla_ladder(cfg: dict) -> list:
    """The portable sparse-MLA configurations :func:`search_mla_configs` tries, nearest to ``cfg`` (the H200's)
    first: most heads per program, then most rows per tile, then most pipeline stages, each with ``cfg``'s warps,
    then half and twice as many (2-8)."""
    out = []
    bh = cfg["block_h"]
    while bh >= 16:
        w0 = max(2, cfg["num_warps"] * bh // cfg["block_h"])
        bn = cfg["block_n"]
        while bn >= 16:
            for st in range(cfg["num_stages"], 0, -1):
                for w in [w0] + [w for w in (w0 // 2, w0 * 2) if 2 <= w <= 8]:
                    out.append(dict(cfg, block_h=bh, block_n=bn, num_stages=st, num_warps=w))
            bn //= 2
        bh //= 2
    return out


def search_mla_configs(arg: str) -> dict:
    """For each case of :data:`dsa.mla.kernel.TARGET_CONFIGS`, the first configuration of :func:`mla_ladder` from
    the H200's that compiles for target ``arg`` within its shared memory and spills at most :data:`SPILL_OK` bytes,
    unsplit and split; prints each try.
    Returns ``{(is_fp8, block_h, small_t): config changes}``, the entries for the target's table."""
    record = install(arg)
    from dsa.mla import kernel as mk

    picks = {}
    for is_fp8, bh, small_t in mk.TARGET_CASES:
        T = 1 if small_t else 64
        cfg = mk.default_config(bh, is_fp8, T)
        S = 512
        kv = torch.zeros(S, 656, dtype=torch.uint8) if is_fp8 else torch.randn(S, 576).to(torch.bfloat16)
        q = torch.randn(T, bh, 576).to(torch.bfloat16)
        idx = torch.randint(0, S, (T, 256), dtype=torch.int32)
        for c in mla_ladder(cfg):
            try:  # unsplit and split (partials in fp32): both variants
                spilled = 0
                for splits in (1, 2):
                    mk.sparse_mla_triton(q, kv, idx, 0.1, num_splits=splits, config=c)
                    spilled = max(spilled, record["last"]["_sparse_mla_fwd_kernel"])
            except OutOfResources:
                spilled = None
            print(f"fp8={is_fp8} h={bh} small_t={small_t} {c}: " + ("too much shared memory" if spilled is None
                                                                   else f"{spilled} spill bytes"), flush=True)
            if spilled is not None and spilled <= SPILL_OK:
                picks[(is_fp8, bh, small_t)] = {k: v for k, v in c.items() if cfg.get(k) != v}
                break
    return picks


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    if len(sys.argv) > 2 and sys.argv[2] == "--search-mla":
        for case, change in search_mla_configs(sys.argv[1]).items():
            print(case, change)
        sys.exit(0)
    sys.exit(main(sys.argv[1]))
