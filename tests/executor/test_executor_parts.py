"""The pieces on their own: pool moves, demo checkpoints, dtypes, the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from oracle import Oracle
from executor_service.attention import load_backend
from executor_service.kv_pool import KvPool, block_bytes
from executor_service.tables import TableChanges
from executor_service.step import StepInput

REPO = Path(__file__).resolve().parents[2]


def _pool(num_blocks=8, swap=4) -> KvPool:
    pool = KvPool(num_layers=3, num_blocks=num_blocks, block_size=2, num_kv_heads=2, head_dim=4,
                  num_swap_blocks=swap, dtype=torch.float32, device=torch.device("cpu"), backend=load_backend("torch"))
    pool.kv.copy_(torch.randn_like(pool.kv))
    return pool


def test_pool_swap_out_in_and_copy_move_whole_blocks_of_every_layer():
    pool = _pool()
    before = pool.kv.clone()
    assert pool.kv.shape == (3, 2, 8, 2, 2, 4)
    assert pool.block_bytes == block_bytes(3, 2, 2, 4, torch.float32) == 3 * 2 * 2 * 2 * 4 * 4
    pool.swap_out(torch.tensor([1, 6]), torch.tensor([3, 0]))
    assert torch.equal(pool.swap[:, :, 3], before[:, :, 1]) and torch.equal(pool.swap[:, :, 0], before[:, :, 6])
    pool.kv.zero_()  # the device blocks get reused
    pool.swap_in(torch.tensor([0, 3]), torch.tensor([2, 5]))
    assert torch.equal(pool.kv[:, :, 2], before[:, :, 6]) and torch.equal(pool.kv[:, :, 5], before[:, :, 1])
    pool.copy(torch.tensor([5, 2]), torch.tensor([7, 0]))
    assert torch.equal(pool.kv[:, :, 7], before[:, :, 1]) and torch.equal(pool.kv[:, :, 0], before[:, :, 6])
    assert torch.count_nonzero(pool.kv[:, :, [1, 3, 4, 6]]) == 0
    # Per-layer views alias the pool.
    k0, v0 = pool.layer_caches()[0]
    assert k0.data_ptr() == pool.kv[0, 0].data_ptr() and v0.shape == (8, 2, 2, 4)
    # Stored head-major: a kv head's rows of a block are contiguous (2 x 4), the heads 8 apart.
    assert k0.stride() == (16, 4, 8, 1) and pool.swap[0, 0].stride() == k0.stride()


def test_demo_model_cli_is_deterministic_and_loads(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from kvpager_tools.cli import main

    args = ["--arch", "mistral", "--layers", "1", "--hidden-size", "32", "--heads", "2", "--kv-heads", "1",
            "--vocab-size", "300"]
    assert main(["demo-model", str(tmp_path / "a"), *args]) == 0
    assert main(["demo-model", str(tmp_path / "b"), *args]) == 0
    assert main(["demo-model", str(tmp_path / "c"), *args, "--seed", "1"]) == 0
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in "abc"]
    assert weights[0] == weights[1] != weights[2]
    tok = AutoTokenizer.from_pretrained(tmp_path / "a", local_files_only=True)
    cfg = AutoConfig.from_pretrained(tmp_path / "a", local_files_only=True)
    assert cfg.model_type == "mistral" and cfg.vocab_size == len(tok) <= 300
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    text = "The quick brown fox"
    assert tok.decode(tok(text).input_ids) == text


def test_ensure_demo_model_builds_once(tmp_path, monkeypatch):
    from kvpager_tools.demo_model import ensure_demo_model

    monkeypatch.setenv("KVPAGER_HOME", str(tmp_path))
    path = ensure_demo_model()
    assert path == tmp_path / "models" / "demo" and (path / "config.json").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp


def _greedy_in_process(executor, prompt: list[int], num_new: int) -> list[int]:
    tokens, ctx, bs = list(prompt), 0, executor.config.block_size
    blocks = list(range(1, 1 + -(-(len(prompt) + num_new) // bs)))
    for step in range(num_new):
        q = len(tokens) - ctx
        # the first step starts the sequence with its whole table; later ones change nothing in it
        tables = TableChanges(started_seq_ids=np.array([7], np.int64), started_context_lens=np.array([0], np.int32),
                              started_offsets=np.array([0, len(blocks)], np.int32),
                              started_block_ids=np.array(blocks, np.int32)) if step == 0 else TableChanges()
        out = executor.execute(StepInput(
            step_id=step, seq_ids=np.array([7], np.int64), query_lens=np.array([q], np.int32),
            token_ids=np.array(tokens[ctx:], np.int32), table_epoch=1, tables=tables,
            context_lens=np.array([ctx], np.int32)))
        ctx = len(tokens)
        tokens.append(int(out.sampled_token_ids[0]))
    return tokens[len(prompt):]


def test_mistral_in_process_matches_generate(tmp_path):
    from executor_service.config import ExecutorConfig
    from kvpager_tools.demo_model import build_demo_model
    from executor_service.executor import Executor

    path = build_demo_model(tmp_path / "mistral", arch="mistral", vocab_size=300, seed=5)
    ex = Executor(ExecutorConfig(model=str(path), num_blocks=16, block_size=4, device="cpu", dtype="float32"))
    assert ex.info().model_type == "mistral"
    prompt = [5, 60, 70, 80, 90, 11]
    assert _greedy_in_process(ex, prompt, 5) == Oracle(str(path)).greedy(prompt, 5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_pool_runs(checkpoints, dtype):
    from executor_service.config import ExecutorConfig
    from executor_service.executor import Executor

    ex = Executor(ExecutorConfig(model=checkpoints("llama_gqa"), num_blocks=16, block_size=4, device="cpu",
                                 dtype=dtype, kv_cache_gib=0.001))
    assert ex.pool.kv.dtype == getattr(torch, dtype) and ex.info().dtype == dtype
    out = _greedy_in_process(ex, [5, 6, 7, 8, 9], 3)
    assert all(0 <= t < ex.runner.vocab_size for t in out)


def test_kv_cache_gib_sizes_the_pool(checkpoints):
    from executor_service.config import ExecutorConfig
    from executor_service.executor import Executor

    ex = Executor(ExecutorConfig(model=checkpoints("llama_gqa"), block_size=16, device="cpu", dtype="float32",
                                 kv_cache_gib=1 / 1024, swap_blocks=None))
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block_size * kv_heads * head_dim * fp32
    assert ex.pool.num_blocks == (1 << 20) // per_block
    assert ex.pool.num_swap_blocks == ex.pool.num_blocks // 2


def test_cli_serves_and_stops_on_sigterm(checkpoints):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpager.v1 import executor_pb2, executor_pb2_grpc

    from kvpager_tools.ports import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "executor_service", "--model", checkpoints("llama_gqa"), "--port", str(port),
         "--num-blocks", "32", "--block-size", "4", "--device", "cpu", "--executor-id", "cli-test"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.1)
            info = executor_pb2_grpc.ExecutorServiceStub(ch).GetInfo(executor_pb2.GetInfoRequest(), timeout=5)
            assert info.executor_id == "cli-test" and info.num_blocks == 32
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bench_reports_in_process_and_grpc(checkpoints):
    import argparse

    from kvpager_tools.bench.executor import add_bench_parser, run

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["executor", "--models", checkpoints("llama_gqa"), "--batch-sizes", "1,3",
                              "--repeats", "1", "--context-len", "5", "--block-size", "4", "--device", "cpu"])
    report = run(args)
    (model,) = report["models"]
    assert [r["batch_size"] for r in model["results"]] == [1, 3]
    for r in model["results"]:
        assert r["in_process_step_s"] > 0 and r["grpc_step_s"] > 0
        assert r["grpc_tokens_per_s"] == r["batch_size"] / r["grpc_step_s"]


async def test_unloadable_model_fails_start(tmp_path):
    from executor_service.config import ExecutorConfig
    from executor_service.service import start_executor_server

    with pytest.raises(Exception):
        await start_executor_server(ExecutorConfig(model=str(tmp_path / "missing"), device="cpu"))


def test_cli_exits_nonzero_when_the_model_cannot_load(tmp_path, capsys):
    import json

    from kvpager_tools.cli import main

    # not a checkpoint directory: the operator's error, found before anything starts
    assert main(["executor", "--model", str(tmp_path / "missing"), "--port", "0", "--device", "cpu"]) == 2
    # looks like one (a Llama config.json) but has no weights: the load fails, one error line, exit 1
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    capsys.readouterr()
    assert main(["executor", "--model", str(tmp_path / "noweights"), "--port", "0", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "executor failed to start" in err and "Traceback" not in err
