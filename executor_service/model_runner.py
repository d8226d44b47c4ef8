"""Loads a Llama-family HF checkpoint and runs flattened paged forwards.

A step's batch is one row ``[1, total_tokens]`` of every sequence's new tokens
(prefill chunks and decodes mixed) with per-token absolute positions; the
attention layers find their pool views and the step's block tables in the
``kvpager_meta`` keyword (see ``executor_service.attention``). Logits are
computed only for the rows that are sampled (``logits_to_keep``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from executor_service.attention import AttentionMetadata, KernelBackend, register_attention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


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

    def __init__(self, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto") -> None:
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
        self.num_packed_linears = pack_linears(self.model) if self.device.type == "cpu" else 0
        self.config = self.model.config
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.model_type: str = text.model_type
        self.num_layers: int = text.num_hidden_layers
        self.num_heads: int = text.num_attention_heads
        self.num_kv_heads: int = getattr(text, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // self.num_heads
        self.vocab_size: int = text.vocab_size
        self.max_position_embeddings: int = text.max_position_embeddings
        # Paged attention has no sliding window: serve at most one window.
        window = getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None
        self.max_model_len: int = min(self.max_position_embeddings, window or self.max_position_embeddings)
        self.eos_token_ids: list[int] = _eos_ids(self.model, text)

    @property
    def num_params(self) -> int:
        return self._num_params

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: KernelBackend,
    ) -> torch.Tensor:
        """Writes the batch's K/V into the pool and returns logits [R, V] fp32
        for ``batch.logits_indices``."""
        plan = None
        if backend.plan_attention is not None:
            k_cache = kv_caches[0][0]  # [NB, BS, KVH, D], as every layer's
            plan = backend.plan_attention(batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                          k_cache.shape[1], k_cache.shape[0])
        meta = AttentionMetadata(
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            kv_caches=kv_caches,
            backend=backend,
            plan=plan,
        )
        out = self.model(
            input_ids=batch.input_ids.unsqueeze(0),      # [1, T]
            position_ids=batch.positions.unsqueeze(0),   # [1, T]
            attention_mask=None,
            use_cache=False,
            logits_to_keep=batch.logits_indices,
            kvpager_meta=meta,
        )
        return out.logits[0].float()  # [R, V]


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight reordered once for oneDNN (CPU).

    The same fp32 math as ``F.linear``, but the default MKL sgemm leaves most
    of an AVX-512 core idle on small batches: measured on the 2-core CI
    machine, a [32, 512] x [512, 1376] product takes 0.23 ms instead of 0.46
    (1.3-3x across the decode and prefill shapes of a step).
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Plain attributes, not parameters: an opaque oneDNN tensor has no storage to save.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every fp32 ``nn.Linear`` of ``model`` for a ``PackedLinear``
    (when torch has oneDNN); returns how many were packed."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return 0
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, PackedLinear(module))
    return len(targets)


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
