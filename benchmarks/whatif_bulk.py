"""What-if timings of ``dsa.mla.kernel_bulk`` (the 16-head fp8 decode kernel): each variant is the module's source
with one kind of work replaced by something cheaper that gives WRONG values, imported under another name and timed
with ``bench_mla_bulk.trace_phases`` (the call's time and the math warps' clocks per tile by phase). How much a
variant saves bounds what making that work cheaper could gain.

* ``noconv``: the fp8 -> f16 conversions (``cvt.rn.f16x2.e4m3x2``) replaced by register moves of the raw words;
* ``noexp``: the softmax's ``exp2`` of the tile's logits replaced by a clamp to [-1, 1];
* ``both``: both;
* ``noqkload``: QK's operand loads from the ring (16 ``LDS.128`` per thread and tile) replaced by the offsets
  themselves as data; ``qkmin``: that and ``noconv``, so QK is its products and the logits' sum alone.

Run on the GPU: ``python benchmarks/whatif_bulk.py VARIANT`` (one variant per process: the module is compiled
from its own copy).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_mla_bulk as B  # noqa: E402

from dsa.mla import kernel_bulk  # noqa: E402

CVT2 = ('"{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l;"\n'
        '                     " cvt.rn.f16x2.e4m3x2 $1, h; }"')
CVT2_NONE = '"mov.b32 $0, $2; mov.b32 $1, $2;"'
PAIR_CVT = ('" mov.b32 {l, h}, x; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h;"\n'
            '                      " mov.b32 {l, h}, y; cvt.rn.f16x2.e4m3x2 $2, l; cvt.rn.f16x2.e4m3x2 $3, h; }"')
PAIR_NONE = '" mov.b32 $0, x; mov.b32 $1, x; mov.b32 $2, y; mov.b32 $3, y; }"'
QKLOAD = '''    """16 fp8 bytes per element of ``off`` (shared offsets), as f16 along four new last dimensions
    ``[..., e0, m0, m1, m2]``: byte ``2 m + e0`` with m = m0 + 2 m1 + 4 m2 (``cvt.rn.f16x2.e4m3x2``, exact)."""
    w0, w1, w2, w3 = _ld4(off)'''
QKLOAD_NONE = QKLOAD.replace("w0, w1, w2, w3 = _ld4(off)", "w0, w1, w2, w3 = off, off + 1, off + 2, off + 3")
EXP = "p = gl.exp2(lg * sm_scale_log2 - gl.expand_dims(m_use, 2))"
EXP_NONE = "p = gl.minimum(gl.maximum(lg * sm_scale_log2 - gl.expand_dims(m_use, 2), -1.0), 1.0)"


def variant(name: str):
    """The module with variant ``name``'s replacements, imported as ``dsa.mla._whatif_<name>``."""
    src = open(kernel_bulk.__file__).read()
    subs = {"noconv": [(CVT2, CVT2_NONE), (PAIR_CVT, PAIR_NONE)], "noexp": [(EXP, EXP_NONE)]}
    subs["both"] = subs["noconv"] + subs["noexp"]
    subs["noqkload"] = [(QKLOAD, QKLOAD_NONE)]
    subs["qkmin"] = subs["noqkload"] + subs["noconv"]
    for old, new in subs[name]:
        assert src.count(old) == 1, f"{name}: the source no longer holds {old!r}"
        src = src.replace(old, new)
    return import_source(src, f"_whatif_{name}")


def import_source(src: str, name: str):
    """``src`` imported as module ``dsa.mla.<name>`` from a file of its own (Gluon and Triton read their kernels'
    source back from the file), registered in ``sys.modules``."""
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"dsa.mla.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "none"
    if name != "none":
        B.KB = variant(name)
    print(f"variant {name}:", flush=True)
    B.trace_phases()
