"""The test suite's watchdog (``tests/conftest.py``): a test that hangs, as one waiting on a deadlocked GPU kernel
would, ends its process after ``DSA_TEST_HANG_S`` seconds with every thread's stack printed, instead of holding the
whole run until its outer time limit."""
import os
import subprocess
import sys
import time

import pytest


def test_a_hanging_test_ends_its_process():
    env = dict(os.environ, DSA_TEST_HANG_S="2", DSA_WATCHDOG_SLEEPER="1")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                        f"{os.path.abspath(__file__)}::test_sleeper"], env=env, capture_output=True, text=True,
                       timeout=300)
    took = time.monotonic() - t0
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Timeout (0:00:02)" in r.stderr and "test_sleeper" in r.stderr, r.stderr[-3000:]
    assert took < 120, took  # (the interpreter's start and dsa's import take a few seconds; the sleep 600)


def test_sleeper():
    """Sleeps far past the watchdog; run only by the test above."""
    if not os.environ.get("DSA_WATCHDOG_SLEEPER"):
        pytest.skip("run by test_a_hanging_test_ends_its_process only")
    time.sleep(600)
