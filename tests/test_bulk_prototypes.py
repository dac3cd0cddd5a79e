"""The bulk-copy benchmark prototype ``benchmarks/bulk_gather.py`` (the fp8 decode prototype grew into
``dsa.mla.kernel_bulk``, tested in ``tests/test_mla_bulk.py``; the bf16 one, ``proto_bulk_mla.py``, is in git
history: bf16 rows by bulk copies measured no faster than ``kernel_sm90``, BENCHMARKS.md twenty-sixth and thirtieth
sessions).

Its Gluon walks run only on an sm_90 GPU, where the script checks them against the Triton walk before it times
anything (BENCHMARKS.md, twenty-fifth session). Here, on any machine: the correctness case it shares with
``bench_mla_bulk.py``, and what the walks' compiled sm_90a code must hold for the numbers recorded for them to stand:
the ring's buffers side by side at the offsets the copies use (``bulk_gather.offsets`` asserts it), the bulk copies
present, no spills."""
import sys

import torch

from utils import BENCHMARKS, compiled_in_subprocess

_COMPILE = r"""
for name, args in (("walk fp8", (656, 4, 1, 4, 1)), ("walk bf16", (1152, 3, 1)), ("walk bf16 alt", (1152, 3, 1, 3, 1)),
                   ("walk bf16 128 B", (1152, 3, 1, 3, 1, 0, 4, 128))):
    k = G.compile_only(*args)
    out[name] = dict(G.sass_counts(k, PRE), bulk_ptx=k.asm["ptx"].count("cp.async.bulk.shared"))
"""
_PRE = ("LDS", "LDG", "STS", "STG", "STL", "LDL", "HMMA", "F2FP", "UBLKCP", "ATOMG")


def test_prototypes_compile_for_sm90():
    c = compiled_in_subprocess(_COMPILE, _PRE)
    for name, counts in c.items():
        assert counts.get("UBLKCP.S.G", 0) > 0, (name, counts)  # the rows go in by bulk copies
    for name in c:
        assert "STL" not in c[name] and "LDL" not in c[name], (name, c[name])
    assert c["walk fp8"]["bulk_ptx"] >= 1 and c["walk bf16"]["bulk_ptx"] >= 1
    # a 1152-byte row by 128-byte pieces: nine copies (a multiple of nine in the PTX, each of the three loaders with
    # at least one row's nine; the compiler repeats the loop body as it likes)
    n = c["walk bf16 128 B"]["bulk_ptx"]
    assert n % 9 == 0 and n >= 27 and c["walk bf16 alt"]["bulk_ptx"] >= 3, c


def test_poisoned_case():
    """The prototypes' correctness case: 5% of the entries invalid (-1 or past the cache), token 1 without a valid
    entry, every row no entry uses poisoned (NaN / 0xFF bytes) and every used row untouched."""
    sys.path.insert(0, BENCHMARKS)
    from bulk_gather import poisoned_case

    from dsa.bench import mla_inputs

    for fmt in ("bf16", "fp8_ds_mla"):
        q, flat, idx = poisoned_case(3, fmt, "cpu")
        _, kv, idx0 = mla_inputs(3, 16, 2048, 3, 32768, fmt, seed=3, dev="cpu")
        clean = kv.reshape(flat.shape)
        S = flat.shape[0]
        assert q.shape == (3, 16, 576) and idx.shape == (3, 2048)
        bad = (idx < 0) | (idx >= S)
        assert bool(bad[1].all()) and 0.03 < float(bad[[0, 2]].float().mean()) < 0.07
        assert bool((idx >= S).any()) and bool((idx[[0, 2]] == -1).any())
        assert torch.equal(idx[~bad], idx0[~bad])  # the valid entries are the inputs' own
        used = torch.zeros(S, dtype=torch.bool)
        used[idx[~bad].long()] = True
        assert torch.equal(flat[used].view(torch.uint8), clean[used].view(torch.uint8))
        if fmt == "bf16":
            assert bool(torch.isnan(flat[~used]).all())
        else:
            assert bool((flat[~used] == 0xFF).all())
