"""`dsa run` (the main job) end to end on a tiny workload served by the engine, with the kernels
(under the CPU interpreter when there is no GPU) checked against the reference backend, and
`dsa bench` on its smoke shapes."""
import json
import subprocess
import sys

import pytest
import torch

from dsa import cli
from utils import DEVICE

TINY = ["--prompt-lens", "40,17,33", "--arrivals", "0,0,2", "--decode-steps", "3", "--heads", "8", "--topk", "16",
        "--layers", "1", "--hidden", "256", "--vocab", "512", "--block-size", "16", "--max-batched-tokens", "48",
        "--max-seqs", "3", "--device", DEVICE]


def _run(capsys, *extra):
    assert cli.main(["run", *TINY, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_run_triton_matches_reference(capsys, kv_format):
    rep = _run(capsys, "--backend", "triton", "--check", "--kv-format", kv_format)
    assert rep["backend"] == "triton"
    chk = rep["check"]
    kinds = {s["kind"] for s in chk["steps"]}
    assert kinds & {"decode", "decode_graph"} and kinds & {"prefill", "mixed"}  # decode_graph: CUDA graphs
    # whole-model logits (a few units large) after bf16 roundings whose order differs between the
    # kernels and the references: within a few bf16 ulps; the discrete decisions agree exactly
    assert chk["logits_max_rel_diff"] < 2e-2
    assert chk["argmax_equal"] and chk["topk_rows_equal_min"] == 1.0
    assert [r["status"] for r in rep["requests"]] == ["finished"] * 3
    assert all(r["output_len"] == 3 and r["ttft_s"] > 0 for r in rep["requests"])
    assert rep["engine"]["blocks_all_returned"]
    assert rep["decode_tokens_per_s"] > 0 and rep["step_latency_ms"]["all"]["n"] == rep["engine"]["steps"]
    graph_steps = rep["step_latency_ms"]["decode_graph"]
    assert (rep["decode_graph_tokens_per_s"] is None) == (not graph_steps), rep["decode_graph_tokens_per_s"]
    assert set(rep["stage_total"]) == {"indexer_logits", "top_k", "attention", "rest"}
    assert rep["stage_total"]["attention"] > 0 and rep["peak_memory_bytes"] > 0


def test_run_reference_text_report(capsys):
    assert cli.main(["run", *TINY, "--backend", "reference", "--chunk", "8"]) == 0
    out = capsys.readouterr().out
    for word in ("TTFT", "decode:", "tokens/s", "p50", "p99", "attention", "indexer_logits", "top_k", "rest",
                 "reference", "peak memory"):
        assert word in out


def test_run_sampled(capsys):
    """--temperature / --top-p: the new tokens are sampled (seeded by --seed), and the report says so."""
    assert cli.main(["run", *TINY, "--backend", "reference", "--temperature", "0.8", "--top-p", "0.9"]) == 0
    assert "sampled (temperature 0.8, top-p 0.9, seed 0)" in capsys.readouterr().out
    rep = _run(capsys, "--backend", "reference", "--temperature", "0.8")
    assert rep["workload"]["temperature"] == 0.8 and rep["workload"]["top_p"] == 1.0
    assert [r["output_len"] for r in rep["requests"]] == [3, 3, 3] and rep["engine"]["blocks_all_returned"]


def test_run_warmup_runs_the_workload_untimed(capsys):
    """--warmup on: the workload runs once untimed first (its seconds reported apart); the timed run is
    the same run as without it (same steps, same outputs), and the engine's blocks all come back."""
    cold = _run(capsys, "--backend", "reference", "--warmup", "off")
    warm = _run(capsys, "--backend", "reference", "--warmup", "on")
    assert cold["warmup_seconds"] is None and warm["warmup_seconds"] > 0
    assert warm["engine"]["steps"] == cold["engine"]["steps"] and warm["engine"]["blocks_all_returned"]
    assert [r["output_len"] for r in warm["requests"]] == [r["output_len"] for r in cold["requests"]] == [3, 3, 3]
    if DEVICE == "cpu":
        assert warm["timed_compiles"] is None  # nothing is compiled under the interpreter: not counted


def test_compile_counter_counts_and_chains():
    """The timed run's count of first-launched kernel variants comes from Triton's cache hook: every
    call counts, a hook set before keeps being called, and it is restored afterwards."""
    from triton import knobs

    from dsa.pipeline import _CompileCounter

    calls = []
    knobs.runtime.jit_cache_hook = lambda *a, **k: calls.append(k) or False
    try:
        prev = knobs.runtime.jit_cache_hook
        with _CompileCounter() as c:
            for i in range(3):
                assert knobs.runtime.jit_cache_hook(key=i, fn=None) is False
        assert c.count == 3 and len(calls) == 3 and knobs.runtime.jit_cache_hook is prev
    finally:
        knobs.runtime.jit_cache_hook = None


def test_run_rejects_unservable_request_clearly(capsys):
    rep = _run(capsys, "--backend", "reference", "--num-blocks", "3", "--prompt-lens", "40,17,200",
               "--arrivals", "0,0,0")
    st = [r["status"] for r in rep["requests"]]
    assert st == ["finished", "finished", "rejected"]
    assert "too large" in rep["requests"][2]["error"]


def test_console_entry_point_info():
    out = subprocess.run([sys.executable, "-m", "dsa", "info"], capture_output=True, text=True, check=True).stdout
    assert "auto backend" in out
    assert "Hopper kernels (Gluon): " in out
    assert "fp8 e4m3fn in the portable kernels: " in out


def test_bad_arguments_are_clear(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--prompt-lens", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    assert cli.main(["run", *TINY, "--arrivals", "0,1"]) == 2
    assert "arrivals" in capsys.readouterr().err
    assert cli.main(["run", *TINY, "--temperature", "1", "--top-p", "0"]) == 2
    assert "top_p: expected a value in (0, 1]" in capsys.readouterr().err


def test_bench_smoke_json(capsys):
    """`dsa bench` runs every kernel suite (tiny shapes under the interpreter without a GPU) and
    reports time, rate, % of ceiling and the PyTorch baseline per row."""
    from utils import ON_GPU

    assert cli.main(["bench", "--smoke", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    kernels = [r["kernel"] for r in rep["rows"]]
    assert kernels.count("indexer") == 5 and kernels.count("topk") == 3 and kernels.count("mla") == 2
    for r in rep["rows"]:
        assert r["ms"] > 0 and r["unit"] in ("TFLOP/s", "GB/s") and r["base_ms"] > 0 and r["pct_ceiling"] >= 0
    assert rep["device"] != "" and ("cpu" in rep["device"]) != ON_GPU


def test_bench_plot_and_bad_kernel(capsys, tmp_path):
    assert cli.main(["bench", "--smoke", "--kernels", "nope"]) == 2
    assert "--kernels" in capsys.readouterr().err
    png = tmp_path / "b.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert cli.main(["bench", "--smoke", "--kernels", "mla", "--plot", str(png)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err and not png.exists()
    else:
        assert cli.main(["bench", "--smoke", "--kernels", "mla", "--plot", str(png)]) == 0
        assert png.stat().st_size > 1000


def test_run_checkpoint(capsys, tmp_path):
    """`dsa run --model DIR` serves a checkpoint (here the tiny one, with MoE layers)."""
    from dsa.model import make_tiny_model

    d = make_tiny_model(str(tmp_path / "tiny"), seed=0)
    rep = _run(capsys, "--model", d, "--backend", "reference", "--kv-format", "fp8_ds_mla", "--chunk", "16")
    assert rep["model"]["source"] == d and rep["model"]["layers"] == 3 and rep["model"]["vocab"] == 512
    assert [r["status"] for r in rep["requests"]] == ["finished"] * 3
    assert rep["engine"]["cuda_graph"] == "off"


def test_interleaved_us_rounds(monkeypatch):
    """``dsa.bench.interleaved_us`` (the A/B scripts' timing): every round times each function once, in the given
    order, by CUDA-graph replay for decode and ``do_bench`` otherwise; microseconds per round."""
    import triton.testing

    from dsa.bench import interleaved_us

    calls = []
    monkeypatch.setattr(triton.testing, "do_bench",
                        lambda fn, rep, return_mode: (calls.append(("eager", fn(), return_mode)), 0.5)[1])
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph",
                        lambda fn, rep, return_mode: (calls.append(("graph", fn(), return_mode)), 0.25)[1])
    fns = {"a": lambda: "a", "b": lambda: "b"}
    assert interleaved_us(fns, 3, graph=False) == {"a": [500.0] * 3, "b": [500.0] * 3}
    assert calls == [("eager", "a", "mean"), ("eager", "b", "mean")] * 3
    calls.clear()
    assert interleaved_us(fns, 2, graph=True, return_mode="median") == {"a": [250.0] * 2, "b": [250.0] * 2}
    assert calls == [("graph", "a", "median"), ("graph", "b", "median")] * 2


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
def test_mla_inputs_pool(fmt):
    """``dsa.bench.mla_inputs(pool_rows=)`` (the ``*_pool`` bench shapes): the same query and context rows as without
    a pool, the context's blocks at distinct places in the pool, NaN in every other row, the lists pointing at the
    same rows there."""
    from dsa.bench import mla_inputs

    q, kv, idx = mla_inputs(5, 16, 100, 2, 256, fmt, block_size=64, seed=4, dev="cpu")
    q2, pool, idx2 = mla_inputs(5, 16, 100, 2, 256, fmt, block_size=64, seed=4, dev="cpu", pool_rows=64 * 20)
    assert torch.equal(q, q2) and pool.shape[0] == 20 and pool.shape[1:] == kv.shape[1:]
    flat, pflat = kv.reshape(512, -1).view(torch.uint8), pool.reshape(64 * 20, -1).view(torch.uint8)
    assert torch.equal(pflat[idx2.long()], flat[idx.long()])
    used = torch.zeros(20, dtype=torch.bool)
    used[idx2.long().unique() // 64] = True
    assert int(used.sum()) <= 8 and (pflat.view(20, -1)[~used] == 0xFF).all()
    kept = (idx2.long() // 64).unique()
    assert len(kept) == len((idx.long() // 64).unique())  # (each block moved whole)
    with pytest.raises(ValueError, match="pool_rows"):
        mla_inputs(5, 16, 100, 2, 256, fmt, block_size=64, dev="cpu", pool_rows=500)
