"""CPU checks of benchmarks/kernels_gpu.py's shape, byte and FLOP helpers."""

import pytest
import torch

from script_loader import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("benchmarks/kernels_gpu.py") as module:
        yield module


def test_decode_grid_and_memory(bench):
    cases = bench.decode_cases()
    assert len(cases) == 4 * 3 * 2
    assert {(c.batch, c.context, c.block_size) for c in cases} == {
        (b, c, bs) for b in (1, 16, 64, 256) for c in (1024, 4096, 16384) for bs in (16, 64)}
    big = max(cases, key=lambda c: c.memory_bytes)
    # 256 x 16K tokens x 4 kv heads x 128 x bf16, K and V: 8 GiB read per step
    assert big.kv_bytes == 2 * 256 * 16384 * 4 * 128 * 2
    assert big.memory_bytes < 20e9  # pool + contiguous copy fit an 80 GB card easily
    case = bench.DecodeCase(batch=3, context=100, block_size=16)
    assert case.blocks_per_seq == 7 and case.pool_shape == (1, 2, 3 * 7 + 8, 16, 4, 128)


def test_causal_flops_matches_brute_force(bench):
    q_lens, seq_lens, heads, dim = [3, 1, 5], [10, 7, 5], 2, 8
    pairs = 0
    for q, s in zip(q_lens, seq_lens):
        for j in range(q):
            pairs += s - q + j + 1
    assert bench.causal_attention_flops(q_lens, seq_lens, heads, dim) == 4 * pairs * heads * dim


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the benchmark")
def test_exits_cleanly_without_cuda(bench, capsys):
    assert bench.main(["--json"]) == 2
    assert "no CUDA" in capsys.readouterr().err


def test_bench_functions_smoke_on_cpu(bench, monkeypatch):
    # Run the benchmark bodies once at toy sizes through the interpreter:
    # paged results must agree with the script's own SDPA baselines, which
    # validates its GQA-as-query-block decode baseline and prefill mapping.
    monkeypatch.setattr(bench, "_bench_ms", lambda fn: (fn(), 1.0)[1])
    gen = torch.Generator().manual_seed(0)
    case = bench.DecodeCase(batch=2, context=40, block_size=16, num_heads=8, num_kv_heads=2, head_dim=32)
    r = bench.bench_decode(case, gen, dev="cpu")
    assert r["max_abs_diff_vs_sdpa"] < 2e-2 and r["paged_over_contiguous"] == 1.0
    r = bench.bench_prefill(2, 24, 0, gen, dev="cpu", num_heads=8, head_dim=32)
    assert r["max_abs_diff_vs_sdpa"] < 2e-2 and r["flops"] == 4 * 2 * (24 * 25 // 2) * 8 * 32
    r = bench.bench_prefill(1, 8, 20, gen, dev="cpu", num_heads=8, head_dim=32)
    assert "sdpa_tflops" not in r
