"""The conftest's ``--per-function N`` (``tests/conftest.py``): only the first N cases of each test function are
collected, the rest deselected, as the compute-sanitizer pass (``benchmarks/run_sanitizer.sh``) uses it."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _collected(*args):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                        os.path.join(HERE, "test_mla_order.py")], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(HERE))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_per_function_keeps_the_first_cases_of_each_function_in_order():
    every = _collected()
    for n in (1, 2):
        want, seen = [], {}
        for node in every:
            key = node.split("[", 1)[0]
            seen[key] = seen.get(key, 0) + 1
            if seen[key] <= n:
                want.append(node)
        assert _collected("--per-function", str(n)) == want
        assert len(want) < len(every)  # the file has parametrized functions: some cases were dropped
    assert _collected("--per-function", "0") == every


def test_per_function_counts_the_cases_that_k_selected():
    """``-k`` first, then the first N of what it left: a function whose first cases ``-k`` drops keeps later ones."""
    every = _collected()
    picked = [node for node in every if "True" in node]
    assert picked and picked[0] != every[0]
    first, seen = [], set()
    for node in picked:
        key = node.split("[", 1)[0]
        if key not in seen:
            seen.add(key)
            first.append(node)
    assert _collected("-k", "True", "--per-function", "1") == first
