"""Test set-up: on a machine without a GPU every Triton kernel runs under
Triton's CPU interpreter (TRITON_INTERPRET=1, set here before dsa is imported).
Tests marked ``gpu`` use larger shapes and run only when CUDA is present."""
import faulthandler
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import dsa  # noqa: E402,F401  (applies the interpreter fixes)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

# Under pytest-xdist every worker would start one torch thread per core: share the cores
# instead (N workers x all cores oversubscribes the CPU and slows CPU-bound tests many times).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


# A deadlocked GPU kernel blocks the host thread inside a CUDA call, where neither pytest nor a signal handler can
# interrupt it, and the run would wait until its outer time limit. So each test runs under a watchdog thread
# (``faulthandler.dump_traceback_later``) that prints every thread's stack and ends the process after DSA_TEST_HANG_S
# seconds (default 300 with a GPU, off without one; 0: off). Under pytest-xdist the ended worker is reported as that
# test's crash and replaced, and the run goes on.
HANG_S = float(os.environ.get("DSA_TEST_HANG_S", "300" if ON_GPU else "0"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if HANG_S > 0:
        faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        yield
    finally:
        if HANG_S > 0:
            faulthandler.cancel_dump_traceback_later()


def pytest_addoption(parser):
    parser.addoption("--per-function", type=int, default=0, metavar="N",
                     help="run only the first N cases of each test function (0: all), e.g. for a pass under "
                          "compute-sanitizer (benchmarks/run_sanitizer.sh), where every kernel runs 10-100x slower")
    parser.addoption("--no-clusters", action="store_true",
                     help="sparse MLA merges its splits by the merge kernel only, never inside the Hopper kernel's "
                          "clusters (dsa.mla.kernel.cluster_size 0): for racecheck and synccheck, under which every "
                          "test that launched clusters ran past its limit (benchmarks/run_sanitizer.sh)")


@pytest.hookimpl(trylast=True)  # after -k / -m: the first N of each function's selected cases
def pytest_collection_modifyitems(config, items):
    per_function = config.getoption("--per-function")
    if per_function > 0:
        seen: dict[str, int] = {}
        keep, drop = [], []
        for item in items:
            key = item.nodeid.split("[", 1)[0]
            seen[key] = seen.get(key, 0) + 1
            (keep if seen[key] <= per_function else drop).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (larger shapes)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_clusters(request, monkeypatch):
    if request.config.getoption("--no-clusters"):
        from dsa.mla import kernel

        monkeypatch.setattr(kernel, "cluster_size", lambda *args, **kwargs: 0)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test records its own launch plans (dsa._replay): a plan holds what the dispatch rules decided, and tests
    patch those rules."""
    from dsa import _replay

    _replay.clear()
    yield
    _replay.clear()


@pytest.fixture
def device():
    return DEVICE


# The fp8 ops run twice: with Triton's e4m3fn type ("native") and with the software conversions that GPUs without
# it (NVIDIA Ampere) take ("emulated", DSA_FP8_EMULATION=1; dsa.backend.fp8_native). The Gluon (Hopper) kernels
# have no software path: their tests run once.
FP8_MODULES = ("test_mqa_logits", "test_mla", "test_mla_cache", "test_indexer_cache", "test_indexer_prep")
_NATIVE_ONLY = ("sm90", "bulk", "gluon", "hopper")


def pytest_generate_tests(metafunc):
    if "fp8_path" not in metafunc.fixturenames:
        return
    name = metafunc.function.__name__
    if metafunc.module.__name__.rsplit(".", 1)[-1] in FP8_MODULES and not any(s in name for s in _NATIVE_ONLY):
        metafunc.parametrize("fp8_path", ["native", "emulated"], indirect=True)


@pytest.fixture(autouse=True)
def fp8_path(request, monkeypatch):
    path = getattr(request, "param", "native")
    if path == "emulated":
        monkeypatch.setenv("DSA_FP8_EMULATION", "1")
    else:
        monkeypatch.delenv("DSA_FP8_EMULATION", raising=False)
    return path
