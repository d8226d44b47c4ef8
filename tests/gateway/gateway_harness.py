"""A whole kvpager stack in one test process: real memory service, executor(s)
and gateway gRPC servers on loopback, plus the transformers oracle."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from executor_service.config import ExecutorConfig
from executor_service.service import start_executor_server
from gateway.engine import EngineConfig
from gateway.service import GatewayConfig, GatewayServer
from kvpager_tools.ports import free_port
from kvpager.channel import make_channel, wait_for_serving
from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, memory_pb2, memory_pb2_grpc
from memory_service.service import MemoryConfig, MemoryServer


@dataclass
class Stack:
    memory: MemoryServer
    executors: list
    gateway: GatewayServer
    channels: list = field(default_factory=list)

    def __post_init__(self) -> None:
        gch = make_channel(self.gateway.address)
        mch = make_channel(self.memory.address)
        self.channels = [gch, mch]
        self.gw = gateway_pb2_grpc.GatewayStub(gch)
        self.mem = memory_pb2_grpc.MemoryServiceStub(mch)

    async def accounting(self):
        return (await self.mem.GetAccounting(memory_pb2.AccountingRequest())).total

    async def wait_idle(self, timeout_s: float = 10.0):
        """Until every block is free (finished/aborted sequences are released
        in the step after they end)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            t = await self.accounting()
            if t.used_blocks == 0 and t.num_sequences == 0 and t.num_swapped_sequences == 0:
                return t
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"blocks not released: {t}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for ch in self.channels:
            await ch.close()
        await self.gateway.stop(0)
        for ex in self.executors:
            await ex.stop(0)
        await self.memory.stop(0)


async def start_stack(model: str, *, executors: int = 1, num_blocks: int = 96, block_size: int = 4,
                      swap_blocks: int = 64, swap_min_tokens: int = 256, redis_url: str | None = None,
                      **engine_kw) -> Stack:
    memory = await MemoryServer(MemoryConfig(port=0, swap_min_tokens=swap_min_tokens, redis_url=redis_url)).start()
    exs = []
    for i in range(executors):
        exs.append(await start_executor_server(ExecutorConfig(
            model=model, executor_id=f"executor-{i}", memory_address=memory.address, num_blocks=num_blocks,
            block_size=block_size, swap_blocks=swap_blocks)))
    engine_kw.setdefault("executor_refresh_s", 0.2)
    gateway = await GatewayServer(GatewayConfig(model=model, memory_address=memory.address, port=0,
                                                redis_url=redis_url, engine=EngineConfig(**engine_kw))).start()
    await gateway.wait_ready(30)
    while len(gateway.engine.executors) < executors:
        await asyncio.sleep(0.05)
    return Stack(memory, exs, gateway)


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
    """-> {index: (tokens, text, finish_reason, usage)}"""
    req = gateway_pb2.GenerateRequest(prompt_token_ids=prompt_ids or [], prompt=prompt or "",
                                      sampling_params=params(**{k: v for k, v in kw.items()
                                                                if k not in ("priority", "cache_salt",
                                                                             "request_id", "timeout")}),
                                      priority=kw.get("priority", 0), cache_salt=kw.get("cache_salt", ""),
                                      request_id=kw.get("request_id", ""))
    out: dict[int, list] = {}
    async for r in stub.Generate(req, timeout=kw.get("timeout", 60)):
        tokens, text, _, _ = out.setdefault(r.index, [[], "", 0, None])
        tokens.extend(r.token_ids)
        out[r.index][1] = text + r.text
        if r.finish_reason:
            out[r.index][2] = r.finish_reason
            out[r.index][3] = r.usage
    return out


class Oracle:
    """transformers' own generate on the same checkpoint, fp32, eager attention."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                                          attn_implementation="eager")
        self.model.eval()

    def greedy(self, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
        return out[0, len(prompt):].tolist()

    def beams(self, prompt: list[int], max_new_tokens: int, num_beams: int) -> list[int]:
        tokens = self.greedy(prompt, max_new_tokens, num_beams=num_beams)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for i, t in enumerate(tokens):  # a finished beam is padded after its EOS
            if t in eos:
                return tokens[: i + 1]
        return tokens
