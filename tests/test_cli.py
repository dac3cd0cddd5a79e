"""`dsa run` (the main job) end to end on a tiny workload, with the kernels (under the CPU
interpreter when there is no GPU) checked against the reference backend."""
import json
import subprocess
import sys

import pytest

from dsa import cli
from utils import DEVICE

TINY = ["--prompt-lens", "40,17,33", "--decode-steps", "2", "--heads", "8", "--topk", "16", "--block-size", "16",
        "--device", DEVICE]


def _run(capsys, *extra):
    assert cli.main(["run", *TINY, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_run_triton_matches_reference(capsys, kv_format):
    rep = _run(capsys, "--backend", "triton", "--check", "--kv-format", kv_format, "--next-n", "2")
    assert set(rep["backends"].values()) == {"triton"}
    chk = rep["check"]
    assert chk["logits_inf_pattern_equal"] and chk["topk_values_equal"]
    assert chk["logits_max_abs_diff"] < 1e-3
    assert chk["attn_out_max_abs_diff"] < 2e-2  # bf16 output of O(1) values
    assert chk["lse_max_abs_diff"] < 1e-3
    assert len(rep["prefill_seconds"]) == 3 and len(rep["decode_step_seconds"]) == 2
    assert rep["decode_tokens_per_s"] > 0


def test_run_reference_text_report(capsys):
    assert cli.main(["run", *TINY, "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    for word in ("TTFT", "decode:", "attention", "indexer_logits", "top_k", "reference"):
        assert word in out


def test_console_entry_point_info():
    out = subprocess.run([sys.executable, "-m", "dsa", "info"], capture_output=True, text=True, check=True).stdout
    assert "auto backend" in out


def test_bad_arguments_are_clear(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--prompt-lens", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err
