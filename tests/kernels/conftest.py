"""Kernel tests run on CPU through the Triton interpreter when there is no GPU.

The kernels pick compiled-vs-interpreted at *launch* time (kernels/_jit.py),
so setting the variable here works even if another test module imported
``kernels`` first: pytest loads every conftest during collection, before any
test runs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (compiled Triton kernels)")


@pytest.fixture(scope="session")
def device() -> str:
    """Where the Triton kernels run: CUDA when compiled, CPU when interpreted."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


# Per-dtype tolerances for kernel-vs-reference (the reference accumulates in
# fp32 too; the difference is mostly rounding of the stored output).
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(scope="session")
def tol():
    return lambda dtype: TOLERANCES[dtype]
