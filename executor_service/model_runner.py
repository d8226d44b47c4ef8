"""Loads a Llama-family HF checkpoint and runs flattened paged forwards.

A step's batch is one row ``[1, total_tokens]`` of every sequence's new tokens
(prefill chunks and decodes mixed) with per-token absolute positions; the
attention layers find their pool views and the step's block tables in the
``kvpager_meta`` keyword (see ``executor_service.attention``). Logits are
computed only for the rows that are sampled (``logits_to_keep``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.attention import KernelBackend, register_attention
from executor_service.kv_specs import kv_groups, layer_windows
from executor_service.models import llama
from executor_service.models.hf import HFModel
from kvpager.telemetry import get_logger

log = get_logger(__name__)

# gemma2 / gemma3_text: transformers' model code (soft-capping, scaling,
# local/global RoPE) with our paged attention registered into it.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text")
MODEL_IMPLS = ("auto", "kvpager", "transformers")


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors of one forward (built by ``step.build_forward_batch``)."""

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64: absolute position of each token
    slot_mapping: torch.Tensor     # [T] int32
    block_tables: torch.Tensor     # [S, MB] int32
    seq_lens: torch.Tensor         # [S] int32: context + query
    query_start_loc: torch.Tensor  # [S + 1] int32
    logits_indices: torch.Tensor   # [R] int64: token rows whose logits are needed
    # Per table group of the KV layout (group 0 = block_tables / slot_mapping).
    group_block_tables: list[torch.Tensor] | None = None  # [S, MB_g] int32 each
    group_slot_mappings: list[torch.Tensor] | None = None  # [T] int32 each
    # Asked before each layer; true ends the forward there (models.ForwardStopped). A decode
    # burst's later sub-steps carry it, so a cut waits for one layer, not the rest of a forward.
    stop: Callable[[], bool] | None = None

    def tables_of(self, group: int) -> torch.Tensor:
        return self.block_tables if self.group_block_tables is None else self.group_block_tables[group]

    def slots_of(self, group: int) -> torch.Tensor:
        return self.slot_mapping if self.group_slot_mappings is None else self.group_slot_mappings[group]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """``auto``: float32 on CPU; on CUDA the checkpoint's 16-bit dtype, else bfloat16."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype
    return torch.bfloat16


class ModelRunner:
    """One loaded model; ``forward`` is the only per-step entry point."""

    def __init__(self, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto",
                 model_impl: str = "auto") -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported (Llama family: {SUPPORTED_MODEL_TYPES})"
            )
        self.device = resolve_device(device)
        ckpt_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(ckpt_dtype, str):
            ckpt_dtype = getattr(torch, ckpt_dtype, None)
        self.dtype = resolve_dtype(dtype, self.device, ckpt_dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir,
            local_files_only=True,
            dtype=self.dtype,
            attn_implementation=register_attention(),
        ).to(self.device)
        self.model.eval()
        self._num_params = sum(p.numel() for p in self.model.parameters())  # before packing drops weights
        self.config = self.model.config
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.model_type: str = text.model_type
        self.num_layers: int = text.num_hidden_layers
        self.num_heads: int = text.num_attention_heads
        self.num_kv_heads: int = getattr(text, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // self.num_heads
        self.vocab_size: int = text.vocab_size
        self.max_position_embeddings: int = text.max_position_embeddings
        # Each layer's sliding window (None = full attention), as transformers
        # masks it; paged attention honours it, so the context limit is the
        # model's own, never the window.
        self.layer_windows: list[int | None] = layer_windows(text)
        self.kv_groups = kv_groups(text)
        self.max_model_len: int = self.max_position_embeddings
        if any(g.sliding for g in self.kv_groups):
            log.info("sliding-window attention", groups=[(g.window, len(g.layers)) for g in self.kv_groups],
                     max_model_len=self.max_model_len)
        self.eos_token_ids: list[int] = _eos_ids(self.model, text)
        self.model_impl, self.impl = _choose_impl(model_impl, self.model, text, self.layer_windows)
        self.num_packed_linears = getattr(self.impl, "num_packed_linears", 0)
        if self.model_impl != "transformers":
            self.model = None  # our forward holds what it needs; the module tree's weights can go

    @property
    def num_params(self) -> int:
        return self._num_params

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: KernelBackend,
        layer_groups: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Writes the batch's K/V into the pool and returns logits [R, V] fp32
        for ``batch.logits_indices``. layer_groups: each layer's table group
        of the KV layout (None: one table for every layer)."""
        return self.impl.forward(batch, kv_caches, backend, layer_groups)


def _choose_impl(requested: str, hf_model, text_config, windows: list[int | None]):
    """``auto``: our own Llama forward where it reproduces the config, else
    transformers' code; ``kvpager`` insists on ours (an error says why not)."""
    if requested not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {requested!r}")
    if requested != "transformers":
        try:
            impl = llama.LlamaModel(hf_model, text_config, windows)
            return "kvpager", impl
        except llama.Unsupported as exc:
            if requested == "kvpager":
                raise ValueError(f"model_impl 'kvpager' cannot serve this checkpoint: {exc}") from exc
    return "transformers", HFModel(hf_model, windows)


def _eos_ids(model, text_config) -> list[int]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), text_config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        for i in eos if isinstance(eos, (list, tuple)) else [eos]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids
