"""One benchmark request over an OpenAI-compatible HTTP API (ours or another
engine's): ``--backend openai`` streams /v1/completions with the prompt's
token ids (the same workload as gRPC), ``openai-chat`` streams
/v1/chat/completions with the prompt's text as one user message. Both ask
for ``stream_options.include_usage`` (output and cached tokens come from
the usage chunk; a server without it counts one token per chunk). A
token's arrival is its chunk's, text or not: the server sends a chunk per
step with new tokens even while their text is held back (as vLLM does).
"""

from __future__ import annotations

import json
import time

from kvpager_tools.bench.http_client import HttpClient, HttpClientError, Response

BACKENDS = ("grpc", "openai", "openai-chat")


def request_body(backend: str, model: str, prompt_ids: list[int], max_tokens: int, *, ignore_eos: bool,
                 cache_salt: str = "", prompt_text: str | None = None,
                 sampling=None) -> tuple[str, dict]:
    """(path, body) of one streamed request: greedy, or ``sampling``'s (a
    common.BenchSampling) temperature, top_p and top_k (0: off; top_k is
    vLLM's extension, which kvpager's API takes too)."""
    body: dict = {"model": model, "temperature": sampling.temperature if sampling else 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if sampling and sampling.top_p < 1:
        body["top_p"] = sampling.top_p
    if sampling and sampling.top_k:
        body["top_k"] = sampling.top_k
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension other engines ignore or also take
    if cache_salt:
        body["cache_salt"] = cache_salt
    if backend == "openai":
        return "/v1/completions", {**body, "prompt": prompt_ids, "max_tokens": max_tokens}
    if backend == "openai-chat":
        if prompt_text is None:
            raise ValueError("openai-chat needs the prompt's text")
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt_text}],
                                        "max_completion_tokens": max_tokens}
    raise ValueError(f"backend must be one of {BACKENDS[1:]}, got {backend!r}")


def error_message(resp: Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.body[:200].decode(errors="replace")


async def stream_one(client: HttpClient, path: str, body: dict, rec) -> int:
    """Fill ``rec`` (a common.RequestRecord) from one streamed request; returns the HTTP status
    (200 also for an error reported inside the stream, with ``rec.error`` set)."""
    rec.start_s = time.perf_counter()
    num_chunks = 0
    usage = None
    try:
        async for item in client.stream_events(path, body):
            if isinstance(item, Response):
                rec.error = f"HTTP {item.status}: {error_message(item)}"
                return item.status
            arrived, data = item
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = f"stream error: {chunk['error'].get('message')}"
                return 200
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                # a chunk per step with new tokens (their text may be empty); chat's role-only first
                # chunk and a bare finish carry none
                if "text" in choice:
                    has_tokens = bool(choice["text"]) or choice.get("finish_reason") is None
                else:
                    delta = choice.get("delta") or {}
                    has_tokens = "content" in delta and "role" not in delta
                if has_tokens:
                    num_chunks += 1
                    rec.chunk_s.append(arrived)
                    if rec.first_s is None:
                        rec.first_s = arrived
    except HttpClientError as exc:
        rec.error = f"connection: {exc}"
        return 0
    rec.end_s = time.perf_counter()
    rec.num_out = usage["completion_tokens"] if usage else num_chunks
    rec.cached_tokens = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
    return 200


async def served_model(client: HttpClient) -> str:
    """The first model GET /v1/models lists."""
    resp = await client.request("GET", "/v1/models")
    if resp.status != 200:
        raise HttpClientError(f"GET /v1/models: HTTP {resp.status}: {error_message(resp)}")
    return resp.json()["data"][0]["id"]
