"""Our Llama's rotary cos/sin (executor_service.models.llama.Rope) against
transformers' own rotary module (its inv_freq, its attention scaling), bit
for bit, for batches of positions in any order and of any size."""

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
def test_cos_sin_equal_transformers_rotary_bit_for_bit(rope_scaling, head_dim, dtype):
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=4096,
                         rope_scaling=rope_scaling)
    hf = LlamaRotaryEmbedding(config)
    rope = Rope(hf.inv_freq, getattr(hf, "attention_scaling", 1.0))
    gen = torch.Generator().manual_seed(0)
    # batches in no order, odd sizes (a remainder past the vector width), repeated positions
    for positions in (torch.arange(7), torch.randint(0, 300, (33,), generator=gen), torch.tensor([5, 5, 0]),
                      torch.arange(1000, 1003), torch.randint(0, 5000, (129,), generator=gen)):
        cos, sin = rope.cos_sin(positions, dtype)
        x = torch.zeros(1, len(positions), head_dim, dtype=dtype)
        ref_cos, ref_sin = hf(x, positions[None, :])  # [1, T, D], transformers' own computation
        assert cos.shape == (len(positions), head_dim) and cos.is_contiguous() and sin.is_contiguous()
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
