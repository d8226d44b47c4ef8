"""Paged attention plugged into ``transformers`` model code.

The model files stay upstream: we register one attention function under the
name ``kvpager_paged`` with ``transformers.AttentionInterface`` and load the
model with ``attn_implementation="kvpager_paged"``. Each step's metadata
(slot mapping, block tables, lengths, the pool's per-layer views, the kernel
backend) travels *explicitly* as the ``kvpager_meta`` keyword of the model's
forward, which transformers hands down unchanged to every attention call.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from executor_service.models import check_stop

ATTN_IMPLEMENTATION = "kvpager_paged"


@dataclass(frozen=True, slots=True)
class KernelBackend:
    """The four paged-cache kernels, all with ``kvpager_kernels.reference`` signatures."""

    name: str  # "torch" | "cpu" | "triton"
    store_kv: Callable
    paged_attention: Callable
    copy_blocks: Callable
    copy_blocks_all_layers: Callable
    # The torch backend's layer-independent attention work, done once per forward.
    plan_attention: Callable | None = None


def load_backend(name: str) -> KernelBackend:
    """``torch`` = vectorised pure-torch reference; ``cpu`` = the reference
    with attention computed in place by the C++ CPU kernel
    (``kvpager_kernels.cpu_attention``); ``triton`` = the Triton launchers (CUDA, or
    CPU under ``TRITON_INTERPRET=1``)."""
    ops = ("store_kv", "paged_attention", "copy_blocks", "copy_blocks_all_layers")
    if name == "torch":
        mod = importlib.import_module("kvpager_kernels.reference")
    elif name == "triton":
        mod = importlib.import_module("kvpager_kernels")
    elif name == "cpu":
        cpu = importlib.import_module("kvpager_kernels.cpu_attention")
        if not cpu.available():
            raise ValueError("the cpu attention backend did not build (see the log); use 'torch'")
        ref = importlib.import_module("kvpager_kernels.reference")
        fns = {f: getattr(ref, f) for f in ops}
        fns["paged_attention"] = cpu.paged_attention
        return KernelBackend(name=name, plan_attention=cpu.plan_attention, **fns)
    else:
        raise ValueError(f"unknown attention backend {name!r}")
    # Resolve eagerly: a missing launcher fails at start-up, not mid-request.
    fns = {f: getattr(mod, f) for f in ops}
    return KernelBackend(name=name, plan_attention=getattr(mod, "plan_attention", None), **fns)


@dataclass(slots=True)
class AttentionMetadata:
    """Everything one forward's attention layers need. Built per step; never global."""

    slot_mappings: list[torch.Tensor]  # per table group: [T] int32, where each new token's K/V goes
    block_tables: list[torch.Tensor]   # per table group: [S, MB] int32 (rows padded with block 0)
    seq_lens: torch.Tensor         # [S] int32: context + new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache) views
    backend: KernelBackend
    layer_windows: list[int | None]  # per layer: its sliding window (None = full attention)
    layer_groups: list[int]          # per layer: its table group (all 0 in the per-layer KV layout)
    # backend.plan_attention(...) per (table group, window), shared by every layer of that pair
    plans: dict[tuple[int, int | None], object] | None = None
    stop: Callable[[], bool] | None = None  # ForwardBatch.stop, asked before each layer's attention


def plan_windows(backend: KernelBackend, windows: list[int | None], groups: list[int], batch,
                 k_cache: torch.Tensor):
    """One attention plan per distinct (table group, window) of the layers
    (None when the backend plans nothing). batch: the ForwardBatch;
    k_cache: [NB, BS, KVH, D], as every layer's."""
    if backend.plan_attention is None:
        return None
    return {(g, w): backend.plan_attention(batch.tables_of(g), batch.seq_lens, batch.query_start_loc,
                                           k_cache.shape[1], k_cache.shape[0], window=w, dtype=k_cache.dtype,
                                           head_dim=k_cache.shape[3])
            for g, w in set(zip(groups, windows))}


def attend(backend: KernelBackend, plans, group: int, window: int | None, q, k_cache, v_cache, block_tables,
           seq_lens, query_start_loc, scale: float, softcap: float | None = None) -> torch.Tensor:
    """One layer's paged attention with its (group, window)'s plan. q: [T, H, D] -> [T, H, D]."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, float(scale))
    kw = {"window": window, "softcap": softcap}
    if plans is not None:
        kw["plan"] = plans[(group, window)]
    return backend.paged_attention(*args, **kw)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvpager_meta: AttentionMetadata | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention function.

    query: [1, H, T, D]; key, value: [1, KVH, T, D] (one flattened row of all
    sequences' new tokens, RoPE already applied). Writes K/V into this layer's
    pool view, then attends causally over each sequence's cached context
    (paged_attention masks by position and window itself; no mask tensor is
    built). ``sliding_window`` / ``softcap``: what the model code passes for
    this layer (Mistral, Qwen2, Gemma 2); the window must be the one the
    layer's KV spec says, since the block manager frees blocks by it.
    Returns ([1, T, H, D], None).
    """
    if kvpager_meta is None:
        raise RuntimeError("kvpager_paged attention called without kvpager_meta; run the model through ModelRunner")
    meta = kvpager_meta
    if query.shape[0] != 1:
        raise RuntimeError("kvpager_paged expects one flattened batch row")
    if kwargs.get("s_aux") is not None:
        raise RuntimeError("attention sinks (s_aux) are not supported by kvpager_paged")
    layer = module.layer_idx
    check_stop(meta.stop, layer)
    window = meta.layer_windows[layer]
    if (sliding_window or None) != window:
        raise RuntimeError(f"layer {layer}: the model passes sliding_window {sliding_window}, its KV spec says "
                           f"{window}")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()    # [T, KVH, D]
    v = value[0].transpose(0, 1).contiguous()  # [T, KVH, D]
    k_cache, v_cache = meta.kv_caches[layer]
    group = meta.layer_groups[layer]
    meta.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mappings[group])
    out = attend(meta.backend, meta.plans, group, window, q, k_cache, v_cache, meta.block_tables[group],
                 meta.seq_lens, meta.query_start_loc, scaling, softcap)  # [T, H, D]
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register ``kvpager_paged`` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
