"""Our Llama's rotary tables (executor_service.models.llama.Rope): on CPU a
forward gathers cos/sin rows from per-dtype tables; every row must be exactly
what computing that position alone gives, and the reference is transformers'
own rotary module (its inv_freq, its attention scaling)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from executor_service.models.llama import Rope


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_transformers_rotary_bit_for_bit(rope_scaling, head_dim, dtype):
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096,
                         rope_scaling=rope_scaling)
    hf = LlamaRotaryEmbedding(config)
    rope = Rope(hf.inv_freq, getattr(hf, "attention_scaling", 1.0))
    gen = torch.Generator().manual_seed(0)
    # batches in no order, odd sizes (a remainder past the vector width), and one past the table (it grows)
    for positions in (torch.arange(7), torch.randint(0, 300, (33,), generator=gen), torch.tensor([5, 5, 0]),
                      torch.arange(1000, 1003), torch.randint(0, 5000, (129,), generator=gen)):
        cos, sin = rope.cos_sin(positions, dtype)
        x = torch.zeros(1, len(positions), head_dim, dtype=dtype)
        ref_cos, ref_sin = hf(x, positions[None, :])  # [1, T, D], transformers' own computation
        assert cos.shape == (len(positions), head_dim) and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
        assert torch.equal(cos, rope.compute(positions, dtype)[0])
    assert rope._tables[dtype][0].shape[0] == 8192  # grown to the power of two past 5,000


def test_empty_positions_and_tables_per_dtype():
    rope = Rope(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.0)
    cos, sin = rope.cos_sin(torch.zeros(0, dtype=torch.int64), torch.float32)
    assert cos.shape == (0, 16) and sin.shape == (0, 16)
    rope.cos_sin(torch.tensor([3]), torch.float32)
    rope.cos_sin(torch.tensor([3]), torch.bfloat16)
    assert {d: t[0].shape[0] for d, t in rope._tables.items()} == {torch.float32: Rope.MIN_TABLE,
                                                                   torch.bfloat16: Rope.MIN_TABLE}
