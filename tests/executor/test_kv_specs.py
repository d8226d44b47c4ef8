"""Per-layer attention specs read from transformers configs, and the
checkpoints refused at start because paged attention cannot honour them."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

from executor_service.kv_specs import UnsupportedAttention, kv_groups, layer_windows
from kvpager.kv_spec import KvGroupSpec, group_layers


def test_windows_per_family():
    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == [None, None]
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=32)) == [32, 32, 32]
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64, max_window_layers=3)
    assert layer_windows(qwen) == [None, None, None, 64]
    assert layer_windows(Qwen2Config(num_hidden_layers=2, use_sliding_window=False)) == [None, None]
    assert layer_windows(Gemma2Config(num_hidden_layers=4, sliding_window=8)) == [8, None, 8, None]


def test_groups_full_first_then_by_window():
    assert group_layers([8, None, 4, 8]) == [KvGroupSpec(None, (1,)), KvGroupSpec(4, (2,)), KvGroupSpec(8, (0, 3))]
    assert [g.window for g in kv_groups(Gemma2Config(num_hidden_layers=2, sliding_window=8))] == [None, 8]


def test_group_block_bound():
    full, sliding = KvGroupSpec(None, (0,)), KvGroupSpec(16, (1,))
    assert full.max_blocks(64, 4) == 16
    assert sliding.max_blocks(64, 4) == 5  # ceil(16 / 4) + 1
    assert sliding.max_blocks(6, 4) == 2


def _edited(config, **fields):
    """transformers validates a config when it is built; a checkpoint's JSON may still say anything."""
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config


@pytest.mark.parametrize("config, match", [
    (_edited(Gemma2Config(num_hidden_layers=2), layer_types=["sliding_attention", "chunked_attention"]),
     "chunked_attention"),
    (_edited(Gemma2Config(num_hidden_layers=2), layer_types=["full_attention"]), "2 layers"),
    (_edited(MistralConfig(num_hidden_layers=2), sliding_window=0), "positive"),
    (_edited(Gemma2Config(num_hidden_layers=2), sliding_window=None), "no sliding_window"),
])
def test_unservable_windows_are_refused(config, match):
    with pytest.raises(UnsupportedAttention, match=match):
        layer_windows(config)
