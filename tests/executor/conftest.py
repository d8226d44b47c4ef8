"""Executor test fixtures: tiny checkpoints, real gRPC servers, the oracle.

* Checkpoints are built once per session (hidden 64, 2 layers) into
  tmp_path_factory: llama MHA, llama GQA, qwen2 (qkv bias).
* Servers are real ``start_executor_server`` instances (grpc.aio on
  127.0.0.1:0 via ServiceRuntime) running on one background event loop, one
  per (checkpoint, backend), shared by the session; tests talk to them with
  ordinary blocking stubs.
* Helpers (``Plan``, ``prompts`` ...) live in executor_harness.py; the oracle in tests/oracle.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
from executor_harness import (
    BLOCK_SIZE,
    CHECKPOINTS,
    NUM_BLOCKS,
    SWAP_BLOCKS,
    LoopThread,
    Served,
    triton_available,
)

from kvpager.v1 import executor_pb2, executor_pb2_grpc
from oracle import Oracle

# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> checkpoint dir, built lazily once per session."""
    from kvpager_tools.demo_model import build_demo_model

    built: dict[str, str] = {}
    root = tmp_path_factory.mktemp("ckpt")

    def get(name: str) -> str:
        if name not in built:
            built[name] = str(build_demo_model(root / name, vocab_size=320, max_position_embeddings=256,
                                               **CHECKPOINTS[name]))
        return built[name]

    return get


@pytest.fixture(scope="session")
def oracle(checkpoints):
    cache: dict[str, Oracle] = {}

    def get(name: str) -> Oracle:
        if name not in cache:
            cache[name] = Oracle(checkpoints(name), fixed_length=True)
        return cache[name]

    return get


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def serve(checkpoints, loop_thread):
    """serve(checkpoint_name, backend="torch", **config) -> Served (cached)."""
    from executor_service.config import ExecutorConfig
    from executor_service.service import start_executor_server
    from kvpager.channel import make_channel

    running: dict[tuple, Served] = {}

    def get(name: str, backend: str = "torch", **overrides) -> Served:
        key = (name, backend, tuple(sorted(overrides.items())))
        if key not in running:
            if backend == "triton" and not triton_available():
                pytest.skip("kvpager_kernels.paged_attention (Triton) is not available")
            cfg = dict(model=checkpoints(name), executor_id=f"{name}-{backend}", num_blocks=NUM_BLOCKS,
                       block_size=BLOCK_SIZE, swap_blocks=SWAP_BLOCKS, attention_backend=backend, device="cpu",
                       dtype="float32")
            cfg.update(overrides)
            server = loop_thread.run(start_executor_server(ExecutorConfig(**cfg)))
            channel = make_channel(server.address, aio=False)
            stub = executor_pb2_grpc.ExecutorServiceStub(channel)
            info = stub.GetInfo(executor_pb2.GetInfoRequest(), timeout=10)
            running[key] = Served(server, server.executor, channel, stub, info, name)
        return running[key]

    yield get
    for served in running.values():
        served.channel.close()
        loop_thread.run(served.server.stop(0))
