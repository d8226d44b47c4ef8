"""CPU paged attention that reads K/V in place (the executor's "cpu" backend).

Same signatures as ``kvpager_kernels.reference``. Sequences with short queries
(decodes, small chunks) go to a C++ kernel (``kvpager_kernels/cpu/paged_attention.cpp``)
that walks each block table (scores, softmax, weighted values; in a 16-bit
dtype rounded where transformers' eager attention rounds): no gathered copy
of the context per layer and step. So do prefill chunks small enough that the
kernel's vector arithmetic beats a separate SDPA call for the sequence (its
fixed cost is a gather, a mask and a dispatch per layer): on a CPU without
AMX every prompt up to a few thousand tokens. In the kernel, fp32 chunks of
``TILE_MIN_QUERY`` tokens or more are attended in tiles of up to 16 tokens x
the GQA group (small matrix products over the same block tables). Chunks
past the budget keep the reference's path (one sequence's context gathered once, then
``scaled_dot_product_attention``'s flash kernel), in the model's dtype rather
than the reference's fp32 (bf16 SDPA runs on AMX tiles where there are any).

The C++ is built on first use (``kvpager_kernels.cpu_build``); ``available()`` says
whether it did. Without a compiler the executor uses the torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from kvpager_kernels import cpu_build, reference

# Queries up to this long per sequence always use the in-place kernel.
SHORT_QUERY = 16
# fp32 and bf16 chunks of at least this many queries are attended in tiles
# (kvpager_kernels/cpu/attention_tiles.h: many tokens x the GQA group per K/V row
# read; a 0.5B prefill's attention 28 -> ~18 ms a layer on the AVX-512 EPYC,
# docs/benchmarks.md); decodes walk their one query. 0: never.
TILE_MIN_QUERY = 2
# Longer chunks use it too while (query rows x attended context) stays within
# this many pairs for the pool's dtype, by the CPU's class
# (``cpu_build.cpu_class``); past it, the chunk's gather + SDPA wins. The
# crossovers measured (docs/kernels.md): on an AVX-512 + AMX Xeon 16-bit SDPA
# reaches the matrix units. For one bf16 sequence alone SDPA wins from
# ~190 x 190 (the tiles on AVX512-BF16's pair dot product); in a step of
# many prompts the kernel's one call over every sequence beats an SDPA call
# per sequence up to 256 x 256 (the compare-vllm round's prefill, prompts of
# 16-256 tokens: -5 % in bf16 (0.5B) and -4 % in fp32 (30M) against the old
# budgets of 90 x 90 and 180 x 180); past 256 x 256 bf16 SDPA is 1.5-3x faster.
# Without AMX, with AVX512-BF16 (bf16 tiles on its pair dot product), the
# kernel stays ahead in bf16 up to 2,048 x 16,384 and 1,024 x 32,768 (0.4-0.7
# of SDPA's time on a Zen 5 EPYC) and in fp32 up to 2,048 x 8,192 and
# 512 x 32,768 (0.34-0.63 there; level at 2,048 x 2,048 on a Zen 4 EPYC);
# elsewhere the budgets the fp32 kernel measured before the pair kernel.
IN_PLACE_PAIRS = {
    "amx": {torch.float32: 65536, torch.bfloat16: 65536, torch.float16: 65536},
    "avx512_bf16": {torch.float32: 1 << 24, torch.bfloat16: 1 << 25, torch.float16: 1 << 22},
    "other": {torch.float32: 1 << 20, torch.bfloat16: 1 << 22, torch.float16: 1 << 22},
}


def in_place_pairs(dtype: torch.dtype | None, cpu: str | None = None) -> int:
    """The in-place budget for a ``dtype`` pool (0 for None); ``cpu``: a key
    of ``IN_PLACE_PAIRS`` (None = this machine's ``cpu_build.cpu_class()``)."""
    if dtype is None:
        return 0
    return IN_PLACE_PAIRS[cpu or cpu_build.cpu_class()].get(dtype, 0)


def available() -> bool:
    """Whether the C++ CPU kernels built and loaded (``kvpager_kernels.cpu_build``)."""
    return cpu_build.available()


@dataclass(slots=True)
class CpuAttentionPlan:
    """One forward's split of the batch, shared by every layer."""

    in_place_seqs: torch.Tensor               # [Ss] int64: sequences for the in-place kernel
    long_chunks: list = field(default_factory=list)  # [reference._Prefill]: gathered once, SDPA
    window: int | None = None                     # the sliding window it was planned for


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int, num_blocks: int, window: int | None = None,
                   dtype: torch.dtype | None = None) -> CpuAttentionPlan:
    """``dtype``: the KV pool's (picks ``in_place_pairs``); None = only queries
    up to ``SHORT_QUERY`` in place."""
    qsl = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    # The context a chunk's queries attend (a window bounds it).
    attended = lens if window is None else torch.minimum(lens, q_lens + window - 1)
    in_place = (q_lens <= SHORT_QUERY) | (q_lens * attended <= in_place_pairs(dtype))
    plan = CpuAttentionPlan(in_place_seqs=torch.nonzero(in_place).flatten().contiguous(), window=window)
    for s in torch.nonzero(~in_place).flatten().tolist():
        plan.long_chunks.append(reference._plan_prefill(block_tables, s, qsl, lens, block_size, num_blocks,
                                                        block_tables.device, window))
    return plan


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    plan: Optional[CpuAttentionPlan] = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``kvpager_kernels.reference.paged_attention`` computed in place (see the module
    docstring), with the same sliding ``window`` and ``softcap``.
    q: [T, H, D] -> [T, H, D] in q.dtype."""
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    qsl = query_start_loc if query_start_loc.dtype == torch.int32 else query_start_loc.to(torch.int32)
    if plan is None:
        plan = plan_attention(tables, lens, qsl, k_cache.shape[1], k_cache.shape[0], window, k_cache.dtype)
    elif plan.window != window:
        raise ValueError(f"attention plan made for window {plan.window}, called with {window}")
    if plan.in_place_seqs.numel():
        # 0 = no window / no soft-capping in the C++ signature.
        torch.ops.kvpager_cpu.paged_attention(out, q, k_cache, v_cache, tables.contiguous(), lens.contiguous(),
                                              qsl.contiguous(), plan.in_place_seqs, float(scale), int(window or 0),
                                              float(softcap or 0.0), TILE_MIN_QUERY)
    for c in plan.long_chunks:  # in the model's dtype: the reference upcasts to fp32
        reference._attend_prefill(q, k_cache, v_cache, c, scale, out, softcap, native=True)
    return out
