"""Compile (never launch) every portable Triton kernel that ``dsa``'s ops reach, for a GPU this machine does not have.

    python tests/compile_targets.py 80        # NVIDIA compute capability 8.0 (A100); also 86, 89, 90, 100, 120
    python tests/compile_targets.py gfx942    # AMD MI300 (gfx942); also gfx950

Run without ``TRITON_INTERPRET``. A stand-in Triton driver reports the target, every launch only compiles, and a
kernel that needs more shared memory than the target's GPUs offer raises Triton's ``OutOfResources``, as the real
launch would. The library is told the same facts about the device (:mod:`dsa.backend`: NVIDIA or not, e4m3fn in
Triton or not). Then one call of every public op per variant (formats, block sizes, head counts, split or not) runs
on small CPU tensors with ``backend="triton"``. Prints one line per op and a JSON summary last; exits 1 if any op
failed. ``tests/test_targets.py`` runs it for the targets of CI.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton.runtime.jit as jit
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

#: shared memory per block (opt-in maximum) of each target's GPUs, bytes
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376,
                "gfx942": 65536, "gfx950": 163840}


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


def main(arg: str) -> int:
    key = arg if arg.startswith("gfx") else int(arg)
    target = GPUTarget("hip", arg, 64) if arg.startswith("gfx") else GPUTarget("cuda", key, 32)
    limit = SHARED_LIMIT[key]
    driver.set_active(_Driver(target))
    kernels = {}  # name -> largest shared memory of its compiled variants that fit
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        shared = k.metadata.shared
        if shared > limit:
            raise OutOfResources(shared, limit, "shared memory")
        kernels[self.fn.__name__] = max(kernels.get(self.fn.__name__, 0), shared)
        return k

    jit.JITFunction.run = compile_only

    import dsa
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
    }
    originals = {name: getattr(backend, name) for name in fakes}
    for mod in [m for name, m in sys.modules.items() if name == "dsa" or name.startswith("dsa.")]:
        for name, fake in fakes.items():
            if getattr(mod, name, None) is originals[name]:
                setattr(mod, name, fake)

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

    ops = dict(indexer_cache=indexer_cache, indexer_prep=indexer_prep, mqa_logits=mqa_logits,
               paged_mqa_logits=paged_mqa_logits, top_k=top_k, metadata=metadata, mla_cache=mla_cache,
               sparse_mla=sparse_mla)
    failed = {}
    for name, fn in ops.items():
        try:
            fn()
            print(f"ok    {name}", flush=True)
        except Exception as e:  # report every op, then fail
            lines = str(e).strip().splitlines()
            failed[name] = f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]
            print(f"FAIL  {name}: {failed[name]}", flush=True)
    print(json.dumps(dict(target=arg, fp8_native=fp8, shared_limit=limit, failed=failed, kernels=kernels)))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main(sys.argv[1]))
