"""The gateway tests' pieces: the in-process stack (kvpager_tools.stack), an
executor in its own process to kill, request helpers (the oracle is
tests/oracle.py)."""

from __future__ import annotations

import asyncio
import os
import random
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


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 2-29 random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


async def on_each(stacks, prompt_list, **kw) -> list:
    """Each prompt's completions on each stack in turn (every block back after each)."""
    out = []
    for s in stacks:
        out.append(await asyncio.gather(*(generate(s.gw, p, **kw) for p in prompt_list)))
        await s.wait_idle()
    return out


async def check_stop_string_and_short_limits(stacks, batch) -> None:
    """Two stacks that must agree: the same tokens at max_tokens 1, 2, 3, 5,
    and the same tokens and text up to a stop string found mid-completion."""
    for max_tokens in (1, 2, 3, 5):
        a, b = await on_each(stacks, batch, max_tokens=max_tokens, ignore_eos=True)
        assert [r[0][0] for r in a] == [r[0][0] for r in b]
        assert all(len(r[0][0]) == max_tokens for r in a)
    text = (await generate(stacks[1].gw, batch[0], max_tokens=12, ignore_eos=True))[0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2] or text[:1]
    a, b = await on_each(stacks, batch[:1], max_tokens=12, ignore_eos=True, stop=[stop])
    assert a[0][0][0] == b[0][0][0] and a[0][0][1] == b[0][0][1]  # tokens and text up to the stop
    assert stop not in a[0][0][1] and len(a[0][0][1]) < len(text)


async def greedy_batch_exact(stack, oracle, batch, max_tokens: int) -> list:
    """The prompts at once, greedy to max_tokens: each as transformers' generate."""
    results = await asyncio.gather(*(generate(stack.gw, p, max_tokens=max_tokens, ignore_eos=True) for p in batch))
    for p, res in zip(batch, results):
        assert res[0][0] == oracle.greedy(p, max_tokens, min_new_tokens=max_tokens), p
        assert res[0][3].completion_tokens == max_tokens
    await stack.wait_idle()
    return results


async def check_cancel_mid_stream(stack, batch) -> None:
    """Long streams cancelled 0.3 s in: every block comes back and the stack serves on."""
    tasks = [asyncio.ensure_future(generate(stack.gw, p, max_tokens=200, ignore_eos=True)) for p in batch]
    await asyncio.sleep(0.3)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await stack.wait_idle()
    res = await generate(stack.gw, [5, 6, 7], max_tokens=6, ignore_eos=True)
    assert len(res[0][0]) == 6
    await stack.wait_idle()


async def check_stop_token_mid_completion(stacks, oracle, batch, max_tokens: int, first: int) -> None:
    """Each prompt stopped by a token of its greedy completion (the first new
    one from position ``first`` on): on every stack it ends right there."""
    stops = []
    for p in batch:
        greedy = oracle.greedy(p, max_tokens, min_new_tokens=max_tokens)
        stops.append(next((t for i, t in enumerate(greedy) if i >= first and t not in greedy[:i]), greedy[first]))
    for s in stacks:
        results = await asyncio.gather(*(generate(s.gw, p, max_tokens=max_tokens, ignore_eos=True,
                                                  stop_token_ids=[t]) for p, t in zip(batch, stops)))
        for p, t, res in zip(batch, stops, results):
            greedy = oracle.greedy(p, max_tokens, min_new_tokens=max_tokens)
            assert res[0][0] == greedy[:greedy.index(t) + 1]
        await s.wait_idle()
