"""Matmuls on weights oneDNN has packed (``kvpager_kernels/cpu/packed_gemm.cpp``).

``executor_service.linear.Linear`` keeps each CPU weight only in oneDNN's
blocked layout. For a step of at most ``MAX_ROWS[dtype]`` rows (decode
steps; in fp32 default-sized prefill steps too) it calls this kernel on that same
buffer: on the Zen 5 EPYC 10-12 % faster than oneDNN's own kernels for the
0.5B Llama's linears at 32 rows, and in fp32 2-5 % per shape at 512-2,048
rows, ~10 % over a prefill step's mix of shapes (docs/benchmarks.md). Past
``MAX_ROWS`` oneDNN serves.

The packed tensor is opaque, so ``usable`` admits a weight only after the
kernel's product on a few probe rows matched oneDNN's: a CPU whose oneDNN
picked another layout falls back to oneDNN, never to wrong numbers. On
AMX CPUs oneDNN packs bf16 in another layout (for its AMX tiles), which
take about as long for one row as for sixteen: there a bf16 weight also
keeps a copy in the kernel's layout (``to_panels``: twice its memory), which
the kernel serves for every decode step (``panel_rows``): from 4 rows on
AMX itself (``kvpager_kernels/cpu/packed_gemm.cpp`` amx_gemm), below on
vdpbf16ps; without the AMX form (a kernel that refuses AMX to the process)
only steps of up to ``AMX_BF16_MAX_ROWS`` rows. The reference is
``reference`` (``F.linear`` on the plain weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpager_kernels import cpu_build

# Rows up to which the kernel serves a weight, by dtype. fp32: a whole
# default prefill step (``max_batch_tokens`` 2,048); beyond, the input no
# longer stays in L3 while the panels stream past, and oneDNN ran ahead
# (8,192 rows: the 0.5B q/k/v projection 7-22 % behind it, split into passes
# or not). bf16: decode steps only. Its prefill keeps oneDNN, the library
# transformers' own bf16 linears run on, whose order of sums ours does not
# follow: with our kernel on prefill rows too (4 % off a 0.5B bf16 prefill
# step) greedy bf16 output followed transformers' bf16 ``generate`` for 19.8
# of 64 tokens on average instead of 34.8 (30M; 0.5B 10.5 instead of 12.1).
MAX_ROWS = {torch.float32: 2048, torch.bfloat16: 48}
# bf16 on an AMX CPU, the kernel on a ``to_panels`` copy against oneDNN's AMX
# kernels on the 30M and 0.5B Llamas' linears (2-core AMX Xeon, 2 threads,
# docs/benchmarks.md, thirty-second sitting): 1 row 0.38-0.87x, 2 rows
# 0.40-0.93x, 3 rows 0.52-1.02x, 4 rows 0.56-1.22x (8 rows: 1.0-2.4x) on its
# vdpbf16ps tiles. Where the kernel's AMX form runs (from 4 rows, ``amx_rows``)
# it serves every decode size: the 0.5B linears with 24 layers' weights
# streamed from memory took 0.83x oneDNN's time at 8 rows, 0.73x at 16,
# 0.67x at 32 and 0.85x at 48 (thirty-fifth sitting).
AMX_BF16_MAX_ROWS = 3
PROBE_ROWS = 3
# Rows of the second probe of a ``to_panels`` copy: the kernel's AMX form,
# a whole group of 16 rows and a ragged one.
AMX_PROBE_ROWS = 19


def amx_rows() -> bool:
    """Whether the kernel runs bf16 steps of 4 rows or more on AMX here."""
    return cpu_build.available() and bool(torch.ops.kvpager_cpu.amx_usable())


def panel_rows() -> int:
    """Rows up to which the kernel serves a bf16 ``to_panels`` copy."""
    return MAX_ROWS[torch.bfloat16] if amx_rows() else AMX_BF16_MAX_ROWS
# Probe agreement with oneDNN, relative to the largest output: only the
# order of the sums differs (bf16: plus one rounding of the output).
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def usable(packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None) -> bool:
    """Whether ``gemm`` may serve this oneDNN-packed ``[n, k]`` weight here
    (``panels``: a ``to_panels`` copy of it, read instead: agreement with
    oneDNN's product on the packed one is probed all the same)."""
    dtype = packed.dtype
    if dtype not in PROBE_RTOL or not cpu_build.available():
        return False
    if dtype == torch.bfloat16 and cpu_build.has_amx() and panels is None:
        return False  # oneDNN's AMX layout is not the kernel's (its product would be wrong: the probe says so)
    ours = packed if panels is None else panels
    if not torch.ops.kvpager_cpu.packed_gemm_readable(ours, n, k):
        return False
    gen = torch.Generator().manual_seed(0)
    for rows in (PROBE_ROWS, AMX_PROBE_ROWS) if panels is not None else (PROBE_ROWS,):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "").float()
        got = gemm(x, ours, n, None if bias is None else bias.float()).float()
        scale = want.abs().max().item() or 1.0
        if not (bool(torch.isfinite(got).all()) and (got - want).abs().max().item() <= PROBE_RTOL[dtype] * scale):
            return False
    return True


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A plain ``[n, k]`` weight (n a multiple of 64) in the kernel's layout,
    as a dense tensor: fp32 ``[n / 64][k][64]``, bf16 ``[n / 64][k / 2][64][2]``
    (pairs of k for vdpbf16ps); oneDNN's avx512_core layouts."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // 64, 64, k).permute(0, 2, 1).contiguous()


def panels_pay(dtype: torch.dtype) -> bool:
    """Whether a weight of ``dtype`` is worth a ``to_panels`` copy here: bf16 on an AMX CPU."""
    return dtype == torch.bfloat16 and cpu_build.available() and cpu_build.has_amx()


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias_f32: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] (contiguous, the weight's dtype) @ W.T + bias -> [M, n]."""
    return torch.ops.kvpager_cpu.packed_gemm(x, packed, n, bias_f32)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product from the plain [n, k] weight."""
    return F.linear(x, weight, bias)
