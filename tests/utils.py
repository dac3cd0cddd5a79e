"""Shared helpers for the tests: random ragged workloads, poisoning, comparisons."""
from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def skip_unless_hopper():
    """Skip a test of the Gluon (``kernel_sm90``) kernels unless an NVIDIA Hopper GPU is here."""
    import pytest

    from dsa.backend import on_hopper

    if not (ON_GPU and on_hopper(torch.device("cuda"))):
        pytest.skip("the Gluon kernels are for NVIDIA sm_90")


def skip_unless_gluon_triton():
    """Skip a test of the Gluon kernels' compiled form unless the installed Triton is the release they are
    validated with (:data:`dsa.backend.GLUON_TRITON`); with any other, ``dsa`` never uses them."""
    import pytest

    from dsa.backend import GLUON_TRITON, gluon_validated

    if not gluon_validated():
        pytest.skip(f"the Gluon kernels are validated with Triton {GLUON_TRITON}x only")


def record_launches(monkeypatch, module, key: str | None = None) -> list:
    """Wrap ``module.launch`` so that every call appends its keyword argument ``key`` (or None); returns
    that list (tests use it to prove which kernel served a call). Launch plans are off for the test: a replayed
    call launches its kernels without going through ``launch`` (:mod:`dsa._replay`)."""
    from dsa import _replay

    monkeypatch.setitem(_replay._state, "enabled", False)
    calls = []
    launch = module.launch
    monkeypatch.setattr(module, "launch", lambda *a, **k: (calls.append(k.get(key) if key else None), launch(*a, **k))[1])
    return calls


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no correct kernel writes (NaN for floats, a sentinel otherwise)."""
    if t.dtype.is_floating_point:
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
        else:
            t.fill_(float("nan"))
    elif t.dtype == torch.uint8:
        t.fill_(0xA5)
    else:
        t.fill_(-12345 if t.dtype != torch.bool else False)
    return t


def ragged_lengths(n: int, short: tuple[int, int], long: tuple[int, int], n_long: int, g: torch.Generator) -> list[int]:
    """Many short and a few long lengths (never all multiples of a block)."""
    out = [int(torch.randint(short[0], short[1] + 1, (1,), generator=g)) for _ in range(n - n_long)]
    out += [int(torch.randint(long[0], long[1] + 1, (1,), generator=g)) for _ in range(n_long)]
    perm = torch.randperm(n, generator=g).tolist()
    return [out[i] for i in perm]


def random_block_table(lens: list[int], block_size: int, g: torch.Generator, extra_blocks: int = 3):
    """A shuffled physical block assignment: returns (block_table [B, max_blocks] int32 with -1
    padding... filled with valid ids only where used, num_blocks)."""
    need = [(L + block_size - 1) // block_size for L in lens]
    max_blocks = max(max(need), 1)
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    pos = 0
    for r, nb in enumerate(need):
        bt[r, :nb] = perm[pos:pos + nb].to(torch.int32)
        pos += nb
    return bt, num_blocks


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-30))


#: the benchmark scripts (the bulk-copy prototypes and their compile helpers live there)
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def compiled_in_subprocess(body: str, prefixes: tuple, timeout: int = 900) -> dict:
    """Run ``body`` in a fresh Python without the Triton interpreter, which cannot compile Gluon for sm_90a: with
    ``benchmarks/`` importable, ``bulk_gather`` as ``G``, ``PRE`` = ``prefixes`` and its printing silenced, it fills
    ``out[name]`` (e.g. with ``G.sass_counts(kernel, PRE)``). Returns ``out``. It compiles into an empty Triton cache:
    the cache's key leaves out where a kernel sits in its file, so a cached binary may carry the source lines of an
    earlier version of the file, and the tests that map SASS back to source lines would read stale ones."""
    import json
    import subprocess
    import sys
    import tempfile
    import textwrap

    skip_unless_gluon_triton()
    script = (f"import contextlib, io, json, sys\nsys.path.insert(0, {BENCHMARKS!r})\nimport bulk_gather as G\n"
              f"PRE = {tuple(prefixes)!r}\nout = {{}}\nwith contextlib.redirect_stdout(io.StringIO()):\n"
              + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\nprint(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
