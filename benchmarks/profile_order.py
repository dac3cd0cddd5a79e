"""Nsight Compute on many-token sparse MLA under each grouping of its index lists: does each order hit L2 as
``benchmarks/l2_order_sim.py`` predicts, and does the time follow the DRAM reads? H200, one launch per variant
(the second call's forward kernel, ``--clock-control none``), through ``benchmarks/profile_mla.py``.

    python benchmarks/profile_order.py [SHAPE] [VARIANTS]     # default: prefill_bf16_h16 off,b4,b8,b4s,b8s

SHAPE is a row of ``dsa bench --kernels mla`` (over the bf16 cache, whatever its format); VARIANTS are those of
``benchmarks/ab_mla_order.py``. Prints per variant the kernel's time and SM clock, DRAM bytes read, L2 bytes, L2 hit
rate, and L2 and DRAM throughput as % of their peaks (the sixteenth session's metrics), and where this ncu has them
(``ncu --query-metrics``; ``-`` otherwise) the L2 sectors that SMs requested (``tex``) and the sectors and requests
that crossed from one L2 partition to the other (``ltcfabric``), with their ratio: the H200's L2 is two partitions,
and a row homed in the far one that the near one does not hold costs a crossing. ``l2_order_sim.py`` predicts that
ratio (its lookups per row read, less one) beside the DRAM reads.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys

METRICS = {  # ncu metric: (column, scale to the printed unit)
    "gpu__time_duration.sum": ("ms", 1e3),
    "sm__cycles_elapsed.avg.per_second": ("SM GHz", 1e-9),
    "dram__bytes_read.sum": ("DRAM read GB", 1e-9),
    "lts__t_bytes.sum": ("L2 GB", 1e-9),
    "lts__t_sector_hit_rate.pct": ("L2 hit %", 1.0),
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": ("L2 % peak", 1.0),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("DRAM % peak", 1.0),
}
#: taken where ``ncu --query-metrics`` lists them (names as public profiles of Hopper and Blackwell use them)
FABRIC = {
    "lts__t_sectors_srcunit_tex.sum": ("SM sectors G", 1e-9),
    "lts__t_sectors_srcunit_ltcfabric.sum": ("fabric sectors G", 1e-9),
    "lts__t_requests_srcunit_ltcfabric.sum": ("fabric requests G", 1e-9),
}
CROSSINGS = "crossings per SM sector"  # fabric sectors / SM sectors: l2_order_sim.py's lookups per row read, less 1
PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "n": 1e-9, "u": 1e-6, "m": 1e-3}


def _scale(unit: str) -> float:
    for base in ("byte", "second", "cycle", "hz", "Hz", "s", "B"):  # "s", "B": ncu's short forms ("ns", "GB")
        if unit.endswith(base) and unit[: len(unit) - len(base)] in PREFIX:
            return PREFIX[unit[: len(unit) - len(base)]]
    return 1.0


def to_base(value: str, unit: str) -> float:
    """A value of ncu's CSV in base units (bytes, seconds, cycles per second, %): ``Gbyte``, ``usecond``, ``ns``
    (the H200's ncu for ``gpu__time_duration``), ``cycle/nsecond``, ``Ghz`` ..."""
    v = float(value.replace(",", ""))
    if unit in ("%", ""):
        return v
    num, _, den = unit.partition("/")
    return v * _scale(num) / (_scale(den) if den else 1.0)


def known(metrics: dict) -> dict:
    """Those of ``metrics`` whose base name (before the first dot) ``ncu --query-metrics`` lists."""
    run = subprocess.run(["ncu", "--query-metrics"], capture_output=True, text=True)
    names = {line.split()[0] for line in run.stdout.splitlines() if line.strip()}
    return {m: c for m, c in metrics.items() if m.split(".")[0] in names}


def profile(shape: str, variant: str, metrics: dict = METRICS) -> dict:
    """The ``metrics`` of one launch (see the module docstring), by column."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = ["ncu", "--clock-control", "none", "--csv", "-k", "regex:_sparse_mla_(fwd|sm90)", "--launch-skip", "1",
           "--launch-count", "1", "--metrics", ",".join(metrics), sys.executable,
           os.path.join(here, "profile_mla.py"), shape, "bf16", f"order={variant}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    rows = [r for r in csv.reader(line for line in run.stdout.splitlines() if line.startswith('"'))]
    if not rows or "Metric Name" not in rows[0]:
        sys.exit(f"ncu gave no metrics for {variant} (rc {run.returncode}):\n{run.stdout[-2000:]}\n"
                 f"{run.stderr[-2000:]}")
    head = rows[0]
    name, unit, value = (head.index(k) for k in ("Metric Name", "Metric Unit", "Metric Value"))
    got = {r[name]: to_base(r[value], r[unit]) for r in rows[1:] if r[name] in metrics}
    return {metrics[m][0]: got[m] * metrics[m][1] for m in metrics if m in got}


def l2_mb() -> str:
    """The device's L2 size in MB as the driver gives it (``l2_order_sim.py`` assumes 60), or ``?``."""
    try:
        import torch

        return f"{torch.cuda.get_device_properties(0).L2_cache_size / 2**20:.0f}" if torch.cuda.is_available() else "?"
    except Exception:  # no torch, no driver: the profile itself will say what is missing
        return "?"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    shape = argv[0] if argv else "prefill_bf16_h16"
    variants = (argv[1] if len(argv) > 1 else "off,b4,b8,b4s,b8s").split(",")
    cols = [c for c, _ in METRICS.values()] + [c for c, _ in FABRIC.values()] + [CROSSINGS]
    metrics = METRICS | known(FABRIC)
    print(f"# {shape} over the bf16 cache, one launch per variant (Nsight Compute); L2 {l2_mb()} MB")
    print("| variant | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for v in variants:
        got = profile(shape, v, metrics)
        if got.get("SM sectors G") and "fabric sectors G" in got:
            got[CROSSINGS] = got["fabric sectors G"] / got["SM sectors G"]
        print(f"| {v} | " + " | ".join(f"{got[c]:.3f}" if c in got else "-" for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
