"""The transformers model code with our paged attention registered into it.

Serves any checkpoint transformers loads whose attention goes through
``AttentionInterface`` (see ``executor_service.attention``); on CPU its fp32
``nn.Linear`` weights are packed for oneDNN once (``executor_service.linear``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from executor_service.attention import AttentionMetadata, plan_windows
from executor_service.linear import Linear, onednn_available, packable, upcast_bf16

if TYPE_CHECKING:
    from executor_service.attention import KernelBackend
    from executor_service.model_runner import ForwardBatch


class _PackedModule(torch.nn.Module):
    """An ``nn.Linear`` replaced in the transformers module tree by our Linear."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = Linear(linear.weight, linear.bias, pack=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def pack_linears(model: torch.nn.Module) -> int:
    """Swap every fp32 ``nn.Linear`` of ``model`` for a packed one (when torch
    has oneDNN), and every bf16 one where bf16 is packed or upcast on this CPU
    (``executor_service.linear``); returns how many were swapped."""
    if not onednn_available():
        return 0
    dtypes = {torch.float32}
    if packable(torch.bfloat16) or upcast_bf16():
        dtypes.add(torch.bfloat16)
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype in dtypes]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, _PackedModule(module))
    return len(targets)


class HFModel:
    """A transformers model driven one flattened paged step at a time."""

    def __init__(self, hf_model: torch.nn.Module, windows: list[int | None]) -> None:
        self.model = hf_model
        self.windows = windows  # per layer (None = full attention)
        self.num_packed_linears = pack_linears(hf_model) if next(hf_model.parameters()).device.type == "cpu" else 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                backend: KernelBackend, layer_groups: tuple[int, ...] | None = None) -> torch.Tensor:
        """Writes the batch's K/V into the pool and returns logits [R, V] fp32
        for ``batch.logits_indices``. layer_groups: each layer's table group
        (None: one table for all)."""
        groups = list(layer_groups) if layer_groups is not None else [0] * len(self.windows)
        plans = plan_windows(backend, self.windows, groups, batch, kv_caches[0][0])
        num_groups = max(groups) + 1
        meta = AttentionMetadata(
            slot_mappings=[batch.slots_of(g) for g in range(num_groups)],
            block_tables=[batch.tables_of(g) for g in range(num_groups)],
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            kv_caches=kv_caches,
            backend=backend,
            layer_windows=self.windows,
            layer_groups=groups,
            plans=plans,
            stop=batch.stop,
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
