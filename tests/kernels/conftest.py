"""Kernel tests run on CPU through the Triton interpreter.

Triton fixes compiled-vs-interpreted when it is imported, so
TRITON_INTERPRET must be set before the first ``import triton``; the
repo-wide tests/conftest.py does that (setdefault, so
``TRITON_INTERPRET=0 pytest -m gpu`` on a CUDA box runs compiled). The line
below only covers running this directory with a different rootdir conftest.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> str:
    """Where the Triton kernels run: CUDA when compiled, CPU when interpreted."""
    return "cuda" if compiled_on_cuda() else "cpu"


def compiled_on_cuda() -> bool:
    from kvpager_kernels._jit import is_interpreted
    from kvpager_kernels.triton_store_kv import _store_kv_kernel

    return torch.cuda.is_available() and not is_interpreted(_store_kv_kernel)


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
