"""Rows of logits sorted in descending order with their indices (top-k and
top-p filtering sort every sampled row).

The reference is ``reference_sort_rows``: torch's stable descending sort
(ties in index order, NaN first, -0.0 equal to +0.0). ``sort_rows`` answers
it on the C++ radix sort (``kvpager_kernels/cpu/sort_rows.cpp``) for CPU
fp32 rows, and by the reference elsewhere.
"""

from __future__ import annotations

import torch

from kvpager_kernels import cpu_build


def reference_sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] -> (values, indices) [R, V]: each row descending, ties by index."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference_sort_rows``'s answer, on the C++ kernel where it runs."""
    if (x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1
            and cpu_build.available()):
        values, indices = torch.ops.kvpager_cpu.sort_rows(x)
        return values, indices
    return reference_sort_rows(x)
