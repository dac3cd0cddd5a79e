"""Test set-up: on a machine without a GPU every Triton kernel runs under
Triton's CPU interpreter (TRITON_INTERPRET=1, set here before dsa is imported).
Tests marked ``gpu`` use larger shapes and run only when CUDA is present."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import dsa  # noqa: E402,F401  (applies the interpreter fixes)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (larger shapes)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE
