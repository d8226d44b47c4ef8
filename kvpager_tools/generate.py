"""`kvpager generate`: stream completions from a running gateway.

Also the one client helper everything that streams reuses (the CLI, the
demo, the drills, the benchmarks' load generator, the tests):
``build_request`` (sampling flags -> ``GenerateRequest``), ``stream_generate``
(one streamed call: completions by index, token arrival times, the final
status), ``generate`` (the same, blocking) and ``run_demo`` (the parallel
streaming demo of ``kvpager up --demo``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable


@dataclasses.dataclass(slots=True)
class Completion:
    """One of a request's n completions (or beams), assembled from the stream."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"; None while running
    usage: dict[str, int] = dataclasses.field(default_factory=dict)
    request_id: str = ""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: int = 0                    # the FinishReason number (0 while running)
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # perf_counter of each response with tokens

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("finish", "chunk_times")}


@dataclasses.dataclass(slots=True)
class Stream:
    """How one Generate call went: its completions, its timing, its status."""

    status: str = "OK"                 # "OK", "CANCELLED" (by cancel_after_tokens) or a gRPC status name
    details: str = ""
    retry_after_s: str | None = None   # the server's hint with RESOURCE_EXHAUSTED / UNAVAILABLE
    completions: dict[int, Completion] = dataclasses.field(default_factory=dict)
    started_s: float = 0.0             # perf_counter when the call started
    first_s: float | None = None       # ... when the first tokens arrived
    ended_s: float = 0.0               # ... when the stream ended

    @property
    def ordered(self) -> list[Completion]:
        return [self.completions[i] for i in sorted(self.completions)]

    @property
    def tokens(self) -> dict[int, list[int]]:
        return {i: c.token_ids for i, c in self.completions.items()}

    @property
    def finish(self) -> dict[int, int]:
        return {i: c.finish for i, c in self.completions.items() if c.finish}

    @property
    def first(self) -> list[int]:
        """Completion 0's tokens."""
        c = self.completions.get(0)
        return c.token_ids if c is not None else []

    @property
    def cached_prompt_tokens(self) -> int:
        c = self.completions.get(0)
        return c.usage.get("cached_prompt_tokens", 0) if c is not None else 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.started_s

    @property
    def total_s(self) -> float:
        return self.ended_s - self.started_s


def build_request(
    prompt: str,
    *,
    n: int = 1,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    beam_width: int = 0,
    min_tokens: int = 0,
    priority: int = 0,
    cache_salt: str = "",
    request_id: str = "",
    skip_special_tokens: bool = False,
):
    """A ``GenerateRequest``; temperature 0 is greedy (the wire default)."""
    from kvpager.v1 import common_pb2, gateway_pb2

    params = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n,
        stop=stop or [], stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos,
        beam_width=beam_width, min_tokens=min_tokens)
    if seed is not None:
        params.seed = seed
    return gateway_pb2.GenerateRequest(
        request_id=request_id, prompt=prompt, sampling_params=params, priority=priority,
        cache_salt=cache_salt, skip_special_tokens=skip_special_tokens)


def _finish_name(value: int) -> str | None:
    from kvpager.v1 import common_pb2

    if value == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


async def stream_generate(
    stub,
    request,
    *,
    timeout_s: float | None = None,
    metadata=None,
    on_chunk: Callable[[object, Completion], None] | None = None,
    on_first: Callable[[], None] | None = None,
    cancel_after_tokens: int | None = None,
    raise_errors: bool = True,
) -> Stream:
    """Runs one ``Generate`` on an aio ``GatewayStub``.

    Args:
        on_chunk: called with (response, its completion so far) per response,
            for printing as tokens arrive.
        on_first: called once when the first tokens arrive.
        cancel_after_tokens: cancel the call (client side) once this many
            tokens arrived; the status is then CANCELLED.
        raise_errors: re-raise a failed call (else its status is recorded).
    Raises:
        grpc.aio.AioRpcError: the call failed (with ``raise_errors``).
    """
    import asyncio

    import grpc

    out = Stream(started_s=time.perf_counter())
    call = stub.Generate(request, timeout=timeout_s, metadata=metadata)
    seen = 0
    try:
        async for resp in call:
            now = time.perf_counter()
            c = out.completions.get(resp.index)
            if c is None:
                c = out.completions[resp.index] = Completion(index=resp.index, request_id=resp.request_id)
            c.text += resp.text
            if resp.token_ids:
                c.token_ids.extend(resp.token_ids)
                c.chunk_times.append(now)
                seen += len(resp.token_ids)
                if out.first_s is None:
                    out.first_s = now
                    if on_first is not None:
                        on_first()
            c.logprobs.extend(resp.logprobs)
            if resp.finish_reason:
                c.finish = resp.finish_reason
                c.finish_reason = _finish_name(resp.finish_reason)
                c.usage = {f.name: getattr(resp.usage, f.name) for f in resp.usage.DESCRIPTOR.fields}
            if on_chunk is not None:
                on_chunk(resp, c)
            if cancel_after_tokens is not None and seen >= cancel_after_tokens:
                call.cancel()
                out.status = "CANCELLED"
                break
    except grpc.aio.AioRpcError as err:
        if raise_errors:
            raise
        out.status = err.code().name
        out.details = err.details() or ""
        out.retry_after_s = dict(err.trailing_metadata() or ()).get("retry-after-s")
    except asyncio.CancelledError:
        call.cancel()
        raise
    finally:
        out.ended_s = time.perf_counter()
    return out


def generate(address: str, prompt: str, *, token: str | None = None, timeout_s: float | None = 120.0,
             **sampling) -> list[Completion]:
    """Blocking convenience: one request to the gateway at ``address``."""
    import asyncio

    from kvpager.channel import make_channel
    from kvpager.v1 import gateway_pb2_grpc

    async def main() -> list[Completion]:
        async with make_channel(address, token=token) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            return (await stream_generate(stub, build_request(prompt, **sampling), timeout_s=timeout_s)).ordered

    return asyncio.run(main())


# --- `kvpager generate` -------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running gateway")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--address", default="127.0.0.1:50050", help="gateway host:port")
    p.add_argument("--n", type=int, default=1, help="completions (parallel sampling)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--beam-width", type=int, default=0, help="> 1 turns on beam search")
    p.add_argument("--priority", type=int, default=0, help="lower = served first")
    p.add_argument("--cache-salt", default="", help="isolates this tenant's prefix cache")
    p.add_argument("--skip-special-tokens", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion at the end")
    p.add_argument("--token", default=None,
                   help="bearer token (gateway started with auth; default: $KVPAGER_AUTH_TOKEN)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline of the whole call")
    from kvpager.security import add_client_tls_arguments

    add_client_tls_arguments(p)
    p.set_defaults(func=run)


def request_from_args(args: argparse.Namespace):
    return build_request(
        args.prompt, n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos, beam_width=args.beam_width, min_tokens=args.min_tokens,
        priority=args.priority, cache_salt=args.cache_salt, skip_special_tokens=args.skip_special_tokens)


def _usage_line(c: Completion) -> str:
    u = c.usage
    return (f"[finish: {c.finish_reason}; prompt {u.get('prompt_tokens', 0)} tokens "
            f"({u.get('cached_prompt_tokens', 0)} cached), completion {u.get('completion_tokens', 0)}]")


def run(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from kvpager.channel import make_channel
    from kvpager.v1 import gateway_pb2_grpc

    from kvpager.security import AUTH_TOKEN_ENV, security_from_args

    single = args.n <= 1 and args.beam_width <= 1
    try:
        tls = security_from_args(args).client_tls()
    except ValueError as exc:
        print(f"kvpager generate: {exc}", file=sys.stderr)
        return 2
    token = args.token or os.environ.get(AUTH_TOKEN_ENV) or None

    def on_chunk(resp, c: Completion) -> None:
        if args.json:
            return
        if single:  # stream text as it arrives
            sys.stdout.write(resp.text)
            if c.finish_reason is not None:
                sys.stdout.write("\n")
            sys.stdout.flush()
        elif c.finish_reason is not None:  # n > 1: each completion when it is done
            print(f"[{c.index}] {c.text}", flush=True)
            print(_usage_line(c), file=sys.stderr, flush=True)

    async def main() -> list[Completion]:
        async with make_channel(args.address, tls=tls, token=token) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            return (await stream_generate(stub, request_from_args(args), timeout_s=args.timeout_s,
                                          on_chunk=on_chunk)).ordered

    try:
        completions = asyncio.run(main())
    except grpc.RpcError as exc:
        sys.stdout.flush()
        print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the cancelled call aborts the request on the gateway
        return 130
    if args.json:
        for c in completions:
            print(json.dumps(c.to_dict()))
    elif single and completions:
        print(_usage_line(completions[0]), file=sys.stderr)
    return 0


# --- the demo of `kvpager up --demo` ------------------------------------------------

SYSTEM_PROMPT = ("You are a helpful assistant. Answer briefly and clearly. Attention lets every token look "
                 "at the tokens before it, and paged attention stores that cache in blocks. ")
DEMO_REQUESTS = (  # (user text, sampling) — every prompt starts with SYSTEM_PROMPT
    ("What is the capital of France?", dict(max_tokens=24)),
    ("Tell me a story about a dragon.", dict(max_tokens=32, n=2, temperature=0.8, seed=7)),
    ("Count from one to ten.", dict(max_tokens=24, temperature=0.7, top_p=0.9, seed=1)),
    ("What is the largest planet?", dict(max_tokens=24)),
)


async def run_demo(address: str, console, *, timeout_s: float = 300.0, tls=None,
                   token: str | None = None) -> list[list[Completion]]:
    """Streams DEMO_REQUESTS in parallel, showing every completion grow live.

    They share a system prompt longer than a block, so the later ones hit the
    prefix cache (``cached`` in their usage); the n=2 request forks.
    """
    import asyncio

    from rich.live import Live
    from rich.table import Table

    from kvpager.channel import make_channel
    from kvpager.v1 import gateway_pb2_grpc

    rows: dict[tuple[int, int], Completion] = {}

    def table() -> Table:
        t = Table(title=f"streaming {len(DEMO_REQUESTS)} requests in parallel (shared system prompt)",
                  expand=True)
        t.add_column("req", no_wrap=True)
        t.add_column("prompt (after it)", ratio=1)
        t.add_column("completion", ratio=3)
        t.add_column("finish / tokens\n(cached/prompt)", no_wrap=True)
        for (r, i), c in sorted(rows.items()):
            u = c.usage
            end = (f"{c.finish_reason} / {u.get('completion_tokens', 0)} "
                   f"({u.get('cached_prompt_tokens', 0)}/{u.get('prompt_tokens', 0)})"
                   if c.finish_reason else f"… {len(c.token_ids)}")
            t.add_row(f"{r}.{i}", DEMO_REQUESTS[r][0], c.text, end)
        return t

    async with make_channel(address, tls=tls, token=token) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with Live(table(), console=console, refresh_per_second=12) as live:
            def watcher(r: int):
                def on_chunk(resp, c: Completion) -> None:
                    rows[(r, c.index)] = c
                    live.update(table())
                return on_chunk

            async def one(r: int) -> list[Completion]:
                text, sampling = DEMO_REQUESTS[r]
                request = build_request(SYSTEM_PROMPT + text, **sampling)
                return (await stream_generate(stub, request, timeout_s=timeout_s, on_chunk=watcher(r))).ordered

            # The first request alone warms the prefix cache; the rest share it.
            first = await one(0)
            rest = await asyncio.gather(*(one(r) for r in range(1, len(DEMO_REQUESTS))))
            live.update(table())
    return [first, *rest]
