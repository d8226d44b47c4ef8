"""CPU checks of benchmarks/decode_graphs_gpu.py: its decode batches are what
a decode step is, and it refuses to run without CUDA."""

import pytest
import torch

from script_loader import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("benchmarks/decode_graphs_gpu.py") as module:
        yield module


def test_decode_batch_rows_own_their_blocks(bench):
    b = bench.decode_batch(3, context=37, block_size=16, width=8, device="cpu")
    assert b.block_tables.shape == (3, 8)
    assert b.block_tables[:, :3].tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert b.block_tables[:, 3:].eq(0).all()
    # position 36 = block 2 of the row, offset 4
    assert b.slot_mapping.tolist() == [3 * 16 + 4, 6 * 16 + 4, 9 * 16 + 4]
    assert b.seq_lens.tolist() == [37] * 3 and b.positions.tolist() == [36] * 3
    assert b.query_start_loc.tolist() == [0, 1, 2, 3] and b.logits_indices.tolist() == [0, 1, 2]
    assert bench.pool_blocks([1, 3], 37, 16) == 10
    with pytest.raises(ValueError, match="blocks a sequence"):
        bench.decode_batch(1, context=200, block_size=16, width=8, device="cpu")


def test_a_model_decodes_the_batch(bench, checkpoints):
    from executor_service.attention import load_backend
    from executor_service.model_runner import ModelRunner

    runner = ModelRunner(checkpoints("llama_gqa"), device="cpu", dtype="float32", model_impl="kvpager")
    batch = bench.decode_batch(4, context=10, block_size=4, width=16, device="cpu")
    kv = torch.zeros((runner.num_layers, 2, bench.pool_blocks([4], 10, 4), 4, runner.num_kv_heads, runner.head_dim))
    logits = runner.forward(batch, [(kv[i, 0], kv[i, 1]) for i in range(runner.num_layers)], load_backend("torch"))
    assert logits.shape == (4, runner.vocab_size) and torch.isfinite(logits).all()
    assert kv[:, :, 0].eq(0).all()  # block 0 is nobody's


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_refuses_without_cuda(bench, capsys):
    assert bench.main(["--json"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
