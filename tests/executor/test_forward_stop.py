"""A forward asked to stop (ForwardBatch.stop, a decode burst cut while a
sub-step runs) ends before the layer where it first says so, in both model
implementations: the layers before wrote their K/V into the batch's slots,
the rest wrote nothing, and no logits come back. A batch without ``stop``
(or one that never says so) runs whole, unchanged."""

from __future__ import annotations

import pytest
import torch

from executor_service.attention import load_backend
from executor_service.model_runner import ForwardBatch, ModelRunner
from executor_service.models import ForwardStopped

BS = 4


def _prefill(n: int) -> ForwardBatch:
    """One sequence's first ``n`` tokens in blocks 1.. (block 0 is nobody's)."""
    blocks = -(-n // BS)
    return ForwardBatch(input_ids=torch.arange(3, 3 + n), positions=torch.arange(n),
                        slot_mapping=torch.arange(BS, BS + n, dtype=torch.int32),
                        block_tables=torch.arange(1, 1 + blocks, dtype=torch.int32).view(1, blocks),
                        seq_lens=torch.tensor([n], dtype=torch.int32),
                        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                        logits_indices=torch.tensor([n - 1]))


@pytest.mark.parametrize("impl", ["kvpager", "transformers"])
def test_a_forward_stops_before_the_layer_where_it_is_told_to(checkpoints, impl):
    runner = ModelRunner(checkpoints("llama_gqa"), device="cpu", dtype="float32", model_impl=impl)
    assert runner.num_layers == 2
    backend = load_backend("torch")

    def pool():
        kv = torch.zeros((runner.num_layers, 2, 4, BS, runner.num_kv_heads, runner.head_dim))
        return kv, [(kv[i, 0], kv[i, 1]) for i in range(runner.num_layers)]

    whole_kv, caches = pool()
    batch = _prefill(6)
    want = runner.forward(batch, caches, backend)
    asked = []
    batch.stop = lambda: asked.append(1) is not None and False  # asked before every layer, never stops
    kv, caches = pool()
    assert torch.equal(runner.forward(batch, caches, backend), want) and len(asked) == runner.num_layers
    assert torch.equal(kv, whole_kv)

    layer = iter(range(1 << 30))
    batch.stop = lambda: next(layer) >= 1  # says stop before the second layer
    kv, caches = pool()
    with pytest.raises(ForwardStopped, match="before layer 1"):
        runner.forward(batch, caches, backend)
    assert torch.equal(kv[0], whole_kv[0]) and kv[0].abs().sum() > 0  # the first layer wrote its K/V
    assert kv[1].eq(0).all()                                            # the second never ran

    batch.stop = lambda: True
    kv, caches = pool()
    with pytest.raises(ForwardStopped, match="before layer 0"):
        runner.forward(batch, caches, backend)
    assert kv.eq(0).all()
