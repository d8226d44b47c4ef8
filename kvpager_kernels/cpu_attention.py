"""CPU paged attention that reads K/V in place (the executor's "cpu" backend).

Same signatures as ``kvpager_kernels.reference``. Sequences with short queries
(decodes, small chunks) go to a C++ kernel (``kvpager_kernels/cpu/paged_attention.cpp``)
that walks each block table (scores, softmax, weighted values; in a 16-bit
dtype rounded where transformers' eager attention rounds): no gathered copy
of the context per layer and step. So do prefill chunks small enough that the
kernel's vector arithmetic beats a separate SDPA call for the sequence (its
fixed cost is a gather, a mask and a dispatch per layer): on a CPU without
AMX every prompt up to a few thousand tokens. In the kernel, fp32 and bf16
chunks of ``TILE_MIN_QUERY`` tokens or more are attended in tiles of up to 16
tokens x the GQA group (small matrix products over the same block tables);
fp32 contexts of ``ONLINE_MIN_KEYS`` keys or more (chunks of ``ONLINE_MIN_ROWS``
rows or more) in tiles of ~512 rows that
walk the context in key blocks with an online softmax; bf16 on AVX512-BF16
in tiles (~128 rows from 1,024 keys) that go over the context twice in key
blocks, its scores kept as bf16 (the probabilities are rounded after
normalising). Chunks
past the budget keep the reference's path (one sequence's context gathered once, then
``scaled_dot_product_attention``'s flash kernel), in the model's dtype rather
than the reference's fp32 (bf16 SDPA runs on AMX tiles where there are any).

The C++ is built on first use (``kvpager_kernels.cpu_build``); ``available()`` says
whether it did. Without a compiler the executor uses the torch reference.
"""

from __future__ import annotations

import functools
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
# fp32 tiles of contexts at least this long, in chunks of at least
# ONLINE_MIN_ROWS rows (queries x the GQA group), walk the context in key
# blocks with an online softmax (kvpager_kernels/cpu/attention_online.h):
# their scores stay in L2, a tile keeps ~512 rows, and its exps are 2^x of
# base-2 scores. Against the one-pass tile (Zen 5 EPYC, 2 threads, 8 and 14
# heads over 2 and 8 over 8; docs/kernels.md): 0.68-0.89 of its time at
# 8,192 keys, 0.92-0.98 from 2,048 to 6,000 (0.75-1.01 without GQA),
# level to 17 % slower at 1,024, 10-25 % slower at 128-256; from 2,048 keys
# slower only for chunks of 16-32 rows (1.02-1.28x). 0: never. bf16 tiles
# on AVX512-BF16 (attention_pairs.h) go by key blocks at every length and
# ignore both.
ONLINE_MIN_KEYS = 2048
ONLINE_MIN_ROWS = 64
# bf16 tiles run their two products on AMX where the CPU has it and the head
# dim is a multiple of 32 (kvpager_kernels/cpu/attention_amx.h); False keeps
# AVX512-BF16's pair kernel (tests compare the two).
AMX_TILES = True
# Longer chunks use it too while (query rows x attended context) stays within
# this many pairs for the pool's dtype, by the CPU's class
# (``cpu_build.cpu_class``); past it, the chunk's gather + SDPA wins. The
# crossovers measured (docs/kernels.md): on an AVX-512 + AMX Xeon 16-bit SDPA
# reaches the matrix units. The fp32 tiles (and bf16 ones on AVX512-BF16's
# pair dot product, where the AMX tiles below do not run) beat an SDPA call
# per sequence up to 256 x 256 in a step of many prompts (the compare-vllm
# round's prefill, prompts of 16-256 tokens: -5 % in bf16 (0.5B) and -4 % in
# fp32 (30M) against the old budgets of 90 x 90 and 180 x 180).
# Without AMX, with AVX512-BF16 (bf16 tiles on its pair dot product), the
# kernel stays ahead in bf16 up to 4,096 x 65,536 (0.26-0.34 of SDPA's time
# from 2,048 x 32,768 at 4 and 7 heads a kv head on a Zen 5 EPYC, since its
# tiles go by key blocks) and in fp32 up to 2,048 x 8,192 and
# 512 x 32,768 (0.34-0.63 there; level at 2,048 x 2,048 on a Zen 4 EPYC);
# with the online tiles past ONLINE_MIN_KEYS, fp32 up to 4,096 x 65,536
# (0.36-0.42 of SDPA's time from 4,096 x 32,768 at 4 and 7 heads a kv head,
# Zen 5, with ~512-row online tiles);
# elsewhere the budgets the fp32 kernel measured before the pair kernel.
IN_PLACE_PAIRS = {
    "amx": {torch.float32: 65536, torch.bfloat16: 65536, torch.float16: 65536},
    "avx512_bf16": {torch.float32: 1 << 28, torch.bfloat16: 1 << 28, torch.float16: 1 << 22},
    "other": {torch.float32: 1 << 20, torch.bfloat16: 1 << 22, torch.float16: 1 << 22},
}


# bf16 chunks whose tiles run on AMX (``amx_tiles``) stay in place up to this
# many pairs: the matrix unit computes both tile products, as it does SDPA's.
# For one bf16 prompt alone (0.5B shapes, 2 threads) they took 0.38-0.66 of
# SDPA's time up to 512 x 512, 0.82 at 724 x 724 and 0.95 at 128 x 2,048;
# level from about 512 x 2,048, and SDPA wins past that (1.1-1.9x at 64-512 x
# 4,096-16,384: each tile converts its whole context's V into pairs).
AMX_TILE_PAIRS = 1 << 18


@functools.cache
def _amx_usable() -> bool:
    return cpu_build.available() and bool(torch.ops.kvpager_cpu.amx_usable())


def amx_tiles(dtype: torch.dtype | None, head_dim: int | None) -> bool:
    """Whether the kernel's bf16 tiles for this pool run on AMX here (built
    for it, granted by the OS, a head dim that is a multiple of 32)."""
    return (AMX_TILES and dtype == torch.bfloat16 and head_dim is not None and head_dim % 32 == 0
            and _amx_usable())


def in_place_pairs(dtype: torch.dtype | None, cpu: str | None = None, head_dim: int | None = None) -> int:
    """The in-place budget for a ``dtype`` pool (0 for None); ``cpu``: a key
    of ``IN_PLACE_PAIRS`` (None = this machine's ``cpu_build.cpu_class()``);
    ``head_dim``: the pool's, for chunks that go to the tiles (None = walked
    or unknown: ``IN_PLACE_PAIRS`` alone)."""
    if dtype is None:
        return 0
    budget = IN_PLACE_PAIRS[cpu or cpu_build.cpu_class()].get(dtype, 0)
    return max(budget, AMX_TILE_PAIRS) if amx_tiles(dtype, head_dim) else budget


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
                   dtype: torch.dtype | None = None, head_dim: int | None = None) -> CpuAttentionPlan:
    """``dtype``, ``head_dim``: the KV pool's (pick ``in_place_pairs``);
    dtype None = only queries up to ``SHORT_QUERY`` in place."""
    qsl = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    # The context a chunk's queries attend (a window bounds it).
    attended = lens if window is None else torch.minimum(lens, q_lens + window - 1)
    # Windowed chunks are walked, never tiled.
    budget = in_place_pairs(dtype, head_dim=head_dim if window is None else None)
    in_place = (q_lens <= SHORT_QUERY) | (q_lens * attended <= budget)
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
        plan = plan_attention(tables, lens, qsl, k_cache.shape[1], k_cache.shape[0], window, k_cache.dtype,
                              k_cache.shape[3])
    elif plan.window != window:
        raise ValueError(f"attention plan made for window {plan.window}, called with {window}")
    if plan.in_place_seqs.numel():
        # 0 = no window / no soft-capping in the C++ signature.
        torch.ops.kvpager_cpu.paged_attention(out, q, k_cache, v_cache, tables.contiguous(), lens.contiguous(),
                                              qsl.contiguous(), plan.in_place_seqs, float(scale), int(window or 0),
                                              float(softcap or 0.0), TILE_MIN_QUERY, ONLINE_MIN_KEYS,
                                              ONLINE_MIN_ROWS, AMX_TILES)
    for c in plan.long_chunks:  # in the model's dtype: the reference upcasts to fp32
        reference._attend_prefill(q, k_cache, v_cache, c, scale, out, softcap, native=True)
    return out
