"""Sparse MLA with and without the index lists grouped by slot range first (``order=``, :mod:`dsa.mla.order`),
in interleaved rounds, on the goal shapes that run in one split and on the shapes that set the automatic rule
(:func:`dsa.mla.kernel.order_pays`): fewer tokens, smaller caches. H200.

    python benchmarks/ab_mla_order.py [ROUNDS]

Variants: ``off`` (the lists as given), ``bN`` (grouped into N ranges), ``bNs`` (the same in serpentine order,
``ORDER_SERPENTINE``: in the rows of odd waves, one program per SM each, the ranges from the top down).

Prints per case and variant the median µs (do_bench; CUDA-graph replays for
decode rows) including the grouping kernel, its change against ``off``, the grouping kernel alone, the largest
difference to the ungrouped output, and whether the automatic rule groups.
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import MLA_SHAPES, interleaved_us, mla_inputs  # noqa: E402
from dsa.mla import kernel as K  # noqa: E402
from dsa.mla.order import order_indices  # noqa: E402

VARIANTS = {"off": (0, False), "b2": (2, False), "b4": (4, False), "b8": (8, False), "b4s": (4, True),
            "b8s": (8, True)}


def grouped_call(q, flat, idx, sm, out, buckets, serpentine):
    before, K.ORDER_SERPENTINE = K.ORDER_SERPENTINE, serpentine
    try:
        return K.sparse_mla_triton(q, flat, idx, sm, out=out, order=buckets)
    finally:
        K.ORDER_SERPENTINE = before


# (name, T, h_q, topk, num_req, s_kv, format)
CASES = [(n, *MLA_SHAPES[n]) for n in MLA_SHAPES if MLA_SHAPES[n][0] >= 256]
CASES += [(f"prefill_bf16_h{h}_T{t}", t, h, 2048, 1, 131072, "bf16") for h in (16, 128) for t in (512, 1024)]
CASES += [(f"prefill_bf16_h16_S{s >> 10}K", 4096, 16, 2048, 1, s, "bf16") for s in (32768, 65536)]
CASES += [("prefill_fp8_h16", 4096, 16, 2048, 1, 131072, "fp8_ds_mla")]


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    names = [a for a in sys.argv[2:]]
    sm = 192 ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count  # one wave: a program per SM
    table = []
    for name, T, h, topk, nreq, s_kv, fmt in CASES:
        if names and name not in names:
            continue
        q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, block_size=64)
        flat = kv.reshape(-1, kv.shape[-1])
        outs = {v: torch.full((T, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda") for v in VARIANTS}
        fns = {v: (lambda v=v: grouped_call(q, flat, idx, sm, outs[v], *VARIANTS[v])) for v in VARIANTS}
        for v in VARIANTS:
            fns[v]()
        torch.cuda.synchronize()
        diff = max((outs["off"].float() - o.float()).abs().max().item() for o in outs.values())
        ok = not any(torch.isnan(o).any().item() for o in outs.values())
        times = interleaved_us(fns, rounds, not name.startswith("prefill"))
        t_ord = {v: 1e3 * do_bench(lambda n=n, w=w: order_indices(idx, flat.shape[0], None, n, wave=sms * w,
                                                                   groups=-(-h // 64)), rep=50)
                 for v, (n, w) in VARIANTS.items() if n}
        auto = K.order_pays(T, 1, topk, flat.shape[0], flat.shape[1] * flat.element_size())
        med = {v: sorted(x)[rounds // 2] for v, x in times.items()}
        table.append((name, med, t_ord, diff, ok, auto))
        print(name, {k: [round(x, 1) for x in v] for k, v in times.items()},
              {k: round(v, 1) for k, v in t_ord.items()}, flush=True)
        q = kv = idx = flat = outs = fns = None
        torch.cuda.empty_cache()
    grouped = "/".join(v for v in VARIANTS if v != "off")
    print(f"\n{'case':<24} " + " ".join(f"{v:>13}" for v in VARIANTS)
          + f"  order-kernel µs ({grouped})   diff  ok auto")
    for name, med, t_ord, d, ok, auto in table:
        cells = [f"{med[v]:7.1f} {100 * (med[v] / med['off'] - 1):+5.1f}" if v != "off" else f"{med[v]:13.1f}"
                 for v in VARIANTS]
        print(f"{name:<24} " + " ".join(f"{c:>13}" for c in cells) + "  " +
              "/".join(f"{t_ord[v]:.1f}" for v in t_ord) + f"  {d:.3g} {ok} {auto}")


if __name__ == "__main__":
    main()
