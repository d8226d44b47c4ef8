"""What an executor reports of itself (GetInfo; mirrors kvpager.v1.ExecutorInfo)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ExecutorInfo:
    """What GetInfo reports (mirrors kvpager.v1.ExecutorInfo)."""

    executor_id: str
    model_id: str
    model_type: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""
    device: str = ""
    attention_backend: str = ""
    model_impl: str = ""
    num_blocks: int = 0
    block_size: int = 0
    num_swap_blocks: int = 0
    incarnation: int = 0
    pool_generation: int = 0
    kv_pool_bytes: int = 0
    kv_layout: str = ""
    kv_groups: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (window or 0, layers)
