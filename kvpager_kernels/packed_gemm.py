"""Decode-size matmuls on weights oneDNN has packed (``kvpager_kernels/cpu/packed_gemm.cpp``).

``executor_service.linear.Linear`` keeps each CPU weight only in oneDNN's
blocked layout. For a step of at most ``MAX_ROWS`` rows it calls this
kernel on that same buffer (fp32 16 %, bf16 12 % faster than oneDNN's own
kernels for the 0.5B Llama's linears at 32 rows on an AVX-512 EPYC:
docs/benchmarks.md); larger steps keep oneDNN, ahead there.

The packed tensor is opaque, so ``usable`` admits a weight only after the
kernel's product on a few probe rows matched oneDNN's: a CPU whose oneDNN
picked another layout falls back to oneDNN, never to wrong numbers. On
AMX CPUs bf16 stays with oneDNN (its AMX tiles). The reference is
``reference`` (``F.linear`` on the plain weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpager_kernels import cpu_build

# Rows up to which the kernel beats oneDNN (32-row decode steps; at 64 the
# two were level in fp32).
MAX_ROWS = 48
PROBE_ROWS = 3
# Probe agreement with oneDNN, relative to the largest output: only the
# order of the sums differs (bf16: plus one rounding of the output).
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def usable(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None) -> bool:
    """Whether ``gemm`` may serve this oneDNN-packed ``[n, k]`` weight here."""
    dtype = packed.dtype
    if dtype not in PROBE_RTOL or not cpu_build.available():
        return False
    if dtype == torch.bfloat16 and cpu_build.has_amx():
        return False
    if not torch.ops.kvpager_cpu.packed_gemm_readable(packed, n, k):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, k, generator=gen).to(dtype)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "").float()
    got = gemm(x, packed, n, None if bias is None else bias.float()).float()
    scale = want.abs().max().item() or 1.0
    return bool(torch.isfinite(got).all()) and (got - want).abs().max().item() <= PROBE_RTOL[dtype] * scale


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] (contiguous, the weight's dtype) @ W.T + bias -> [M, n]."""
    return torch.ops.kvpager_cpu.packed_gemm(x, packed, n, bias_f32)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product from the plain [n, k] weight."""
    return F.linear(x, weight, bias)
