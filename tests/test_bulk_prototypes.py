"""The bulk-copy benchmark prototypes (``benchmarks/bulk_gather.py``, ``proto_bulk_mla.py``, ``proto_bulk_fp8.py``).

Their Gluon kernels run only on an sm_90 GPU, where each script checks itself against ``sparse_mla_ref`` (or the
Triton walk) before it times anything (BENCHMARKS.md, twenty-fifth and twenty-sixth sessions). Here, on any machine:
their shared correctness case, and what their compiled sm_90a code must hold for the numbers recorded for them to
stand: the ring's buffers side by side at the offsets the copies use (``bulk_gather.offsets`` asserts it), the
bulk copies present, no spills, and in the fp8 prototype every operand conversion done in registers (its only
shared-memory traffic besides the ring is the logits' sum)."""
import json
import os
import subprocess
import sys

import torch

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

_COMPILE = r"""
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
import bulk_gather as G
import proto_bulk_fp8 as F
import proto_bulk_mla as M

PRE = ("LDS", "LDG", "STS", "STG", "STL", "LDL", "HMMA", "F2FP", "UBLKCP", "ATOMG")
out = {}
with contextlib.redirect_stdout(io.StringIO()):
    for name, args in (("fp8 g4", (4, 0, 2, 1, 0)), ("fp8 rq", (4, 0, 1, 0, 0)),
                       ("fp8 copies", (4, 1, 2, 1, 0)), ("fp8 g4f", (4, 0, 2, 1, 1, 1)),
                       ("fp8 g4f4", (4, 0, 2, 1, 1, 4)), ("fp8 g4f len sink", (4, 0, 2, 1, 1, 1, 1, 1)),
                       ("fp8 g4f4 len sink", (4, 0, 2, 1, 1, 4, 1, 1)),
                       ("fp8 g4f trace", (4, 0, 2, 1, 1, 2, 0, 0, 1)),
                       ("fp8 g4f vc1", (4, 0, 2, 1, 1, 2, 1, 1, 0, 1)),
                       ("fp8 g4f vc2", (4, 0, 2, 1, 1, 2, 1, 1, 0, 2))):
        out[name] = G.sass_counts(F.compile_only(*args), PRE)
    out["bf16 proto"] = G.sass_counts(M.compile_only(2, 4, 0, 1), PRE)
    for name, args in (("walk fp8", (656, 4, 1, 4, 1)), ("walk bf16", (1152, 3, 1))):
        k = G.compile_only(*args)
        out[name] = dict(G.sass_counts(k, PRE), bulk_ptx=k.asm["ptx"].count("cp.async.bulk.shared"))
print(json.dumps(out))
"""


def _compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the interpreter cannot compile Gluon)
    r = subprocess.run([sys.executable, "-c", _COMPILE, _BENCH], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_prototypes_compile_for_sm90():
    c = _compiled()
    for name, counts in c.items():
        assert counts.get("UBLKCP.S.G", 0) > 0, (name, counts)  # the rows go in by bulk copies
    for name in ("fp8 g4", "fp8 g4f", "fp8 g4f4", "fp8 g4f len sink", "fp8 g4f4 len sink", "fp8 g4f trace",
                 "fp8 g4f vc1", "fp8 g4f vc2", "fp8 copies", "bf16 proto", "walk fp8", "walk bf16"):
        assert "STL" not in c[name] and "LDL" not in c[name], (name, c[name])
    g4 = c["fp8 g4"]
    # per thread and 64-row tile: 16 + 16 16-byte operand reads, 256 fp8 -> f16 conversions, 128 + 8 products; the
    # only other shared traffic is the logits' sum (16 8-byte stores) and the output's reorder (16 16-byte stores)
    assert g4["LDS.128"] == 32 and g4["F2FP.F16.E4M3.UNPACK_B"] == 256, g4
    assert g4["HMMA.16816.F32"] == 128 and g4["HMMA.16816.F32.BF16"] == 8, g4
    assert g4["STS.64"] == 16 and g4["STS.128"] == 16 and g4["STG.E.128"] == 16, g4
    # finished in the kernel: at one split the bf16 output in 8-byte stores; at four, one counter per program and the
    # last program's merge (16-byte loads of the partials)
    assert c["fp8 g4f"]["STG.E.64"] == 16 and c["fp8 g4f"]["F2FP.BF16.F32.PACK_AB"] == 32, c["fp8 g4f"]
    assert c["fp8 g4f4"]["LDG.E.128"] == 64 and c["fp8 g4f4"]["STG.E.128"] == 16, c["fp8 g4f4"]
    assert "HMMA.16816.F32" not in c["fp8 copies"], c["fp8 copies"]  # SKIP 1: the copies alone
    assert c["bf16 proto"]["HMMA.16816.F32.BF16"] == 2 * 136, c["bf16 proto"]  # (its loop: two tiles)
    assert c["walk fp8"]["bulk_ptx"] >= 1 and c["walk bf16"]["bulk_ptx"] >= 1


def test_poisoned_case():
    """The prototypes' correctness case: 5% of the entries invalid (-1 or past the cache), token 1 without a valid
    entry, every row no entry uses poisoned (NaN / 0xFF bytes) and every used row untouched."""
    sys.path.insert(0, _BENCH)
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
