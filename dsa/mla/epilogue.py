"""The per-row end of the online softmax, shared by the sparse-MLA kernels (Triton and Gluon), and the outputs
they all return."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def outputs(T: int, h_q: int, d_v: int, device, out: torch.Tensor | None = None):
    """``(out [T, h_q, d_v] bf16, max_logits [T, h_q] f32, lse [T, h_q] f32)``, uninitialised (``out`` as given)."""
    if out is None:
        out = torch.empty(T, h_q, d_v, dtype=torch.bfloat16, device=device)
    return (out, torch.empty(T, h_q, dtype=torch.float32, device=device),
            torch.empty(T, h_q, dtype=torch.float32, device=device))


@triton.jit
def row_stats(l_i, m_i, sink_ptr, offs_h, hmask, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, m_top=None):
    """From the running sum ``l_i`` and max ``m_i`` (log2 units) of each head row: ``(inv, lse, max_logits)``,
    ``out = acc * inv``. ``SPLIT``: a split partial, lse and max in log2 units, ``-inf`` (and ``inv`` 0) when the
    chunk had no valid entry. Else the final values: natural-log lse (without the sink; the sink only enters
    the denominator), ``+inf`` lse / ``-inf`` max and out 0 for a row with no valid entry. ``m_top``: the true
    running max, for max_logits, when ``m_i`` is only the reference the sums were taken against (``-inf`` for a
    row with no valid entry)."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    empty = l_i == 0.0  # l_i >= 1 as soon as one entry is valid
    l_safe = tl.where(empty, 1.0, l_i)
    if SPLIT:
        inv = tl.where(empty, 0.0, 1.0 / l_safe)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        ml = m_i
    else:
        denom = l_i
        if HAS_SINK:
            sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0)
            denom += tl.exp2(tl.where(empty, float("-inf"), sink * LOG2E - m_i))
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, denom))
        lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
        ml = tl.where(empty, float("-inf"), m_i * LN2)
    if m_top is not None:
        ml = m_top if SPLIT else tl.where(m_top == float("-inf"), float("-inf"), m_top * LN2)
    return inv, lse, ml


@triton.jit
def merge_weights(lse_s, sink_ptr, offs_h, hmask, HAS_SINK: tl.constexpr):
    """Merge of split partials by their lse: from ``lse_s [NS, BH]`` (log2 units, ``-inf`` for a split with no
    valid entry or a padding split): ``(w_s [NS, BH], m_use [BH], inv [BH], lse [BH], empty [BH])``. The merged
    output is ``inv * sum_s w_s * out_s`` (``w_s = 2^(lse_s - m_use)``); ``lse`` is the final natural-log lse
    (``+inf`` for a row with no valid entry, the sink only in the denominator, as :func:`row_stats`)."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    m = tl.max(lse_s, 0)
    empty = m == float("-inf")
    m_use = tl.where(empty, 0.0, m)
    w_s = tl.exp2(lse_s - m_use[None, :])
    sumw = tl.sum(w_s, 0)
    denom = sumw
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0)
        denom += tl.exp2(tl.where(empty, float("-inf"), sink * LOG2E - m_use))
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, denom))
    lse = tl.where(empty, float("inf"), (m_use + tl.log2(tl.where(empty, 1.0, sumw))) * LN2)
    return w_s, m_use, inv, lse, empty
