"""The gateway tests' pieces: the in-process stack (kvpager_tools.stack), an
executor in its own process to kill, request helpers (the oracle is
tests/oracle.py)."""

from __future__ import annotations

import os
import subprocess
import sys


from kvpager.channel import wait_for_serving
from kvpager.v1 import common_pb2, gateway_pb2
from kvpager_tools.ports import free_port
from kvpager_tools.stack import start_in_process as start_stack  # noqa: F401 - the gateway tests' stack


def spawn_executor(model: str, memory_address: str, executor_id: str, *, num_blocks: int, block_size: int):
    """An executor in its own process (to be killed)."""
    port = free_port()
    cmd = [sys.executable, "-m", "executor_service", "--model", model, "--port", str(port),
           "--memory-address", memory_address, "--executor-id", executor_id, "--num-blocks", str(num_blocks),
           "--block-size", str(block_size), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, f"127.0.0.1:{port}"


async def wait_port_serving(address: str, timeout_s: float = 60.0) -> None:
    await wait_for_serving(address, timeout_s)


def params(**kw) -> common_pb2.SamplingParams:
    kw.setdefault("max_tokens", 8)
    return common_pb2.SamplingParams(**kw)


async def generate(stub, prompt_ids=None, prompt=None, **kw):
    """-> {index: (tokens, text, finish_reason, usage)} of one greedy-by-default request
    (kvpager_tools.generate.stream_generate underneath)."""
    from types import SimpleNamespace

    from kvpager_tools.generate import stream_generate

    req = gateway_pb2.GenerateRequest(prompt_token_ids=prompt_ids or [], prompt=prompt or "",
                                      sampling_params=params(**{k: v for k, v in kw.items()
                                                                if k not in ("priority", "cache_salt",
                                                                             "request_id", "timeout",
                                                                             "skip_special_tokens")}),
                                      priority=kw.get("priority", 0), cache_salt=kw.get("cache_salt", ""),
                                      request_id=kw.get("request_id", ""),
                                      skip_special_tokens=kw.get("skip_special_tokens", False))
    out = await stream_generate(stub, req, timeout_s=kw.get("timeout", 60))
    return {i: [c.token_ids, c.text, c.finish, SimpleNamespace(**c.usage) if c.usage else None]
            for i, c in out.completions.items()}
