"""Greedy sampling's argmax over each row of logits.

On CPU the C++ kernel (``kvpager_kernels/cpu/argmax.cpp``) answers it; its
reference, and the answer everywhere else (CUDA, other dtypes, the C++
kernels off), is ``reference_argmax_rows``: torch's ``max(dim=-1).indices``
— each row's first maximum, a NaN counting as the maximum.
"""

from __future__ import annotations

import torch

from kvpager_kernels import cpu_build

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> [R] int64: each row's first maximum (or first NaN)."""
    return logits.max(dim=-1).indices


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``reference_argmax_rows``'s answer, on the C++ kernel where it runs
    (a CPU tensor of fp32/bf16/fp16 with contiguous rows)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in _KERNEL_DTYPES
            and logits.size(1) > 0 and logits.stride(1) == 1 and cpu_build.available()):
        return torch.ops.kvpager_cpu.argmax_rows(logits)
    return reference_argmax_rows(logits)
