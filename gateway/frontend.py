"""What every client API does with one request: check, validate, route,
submit, stream, and abort it when its client goes away.

The gRPC servicer and the OpenAI-compatible HTTP layer both call this, so
the two accept the same requests with the same errors (domain errors; each
API maps them to its own statuses) and share one engine. No grpc here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvpager.errors import InvalidArgument, Unavailable
from kvpager.prefix_index.hashing import PromptChain
from gateway import failures
from gateway.params import RawParams, RequestCaps, validate, validate_token_ids
from gateway.state import Output, Request
from gateway.tenants import Tenants

MAX_RETENTION_S = 7 * 24 * 3600.0  # the memory service's limit too


@dataclass(slots=True)
class Submission:
    """One request as an API hands it over (its prompt already in token ids)."""

    prompt_ids: list[int]
    params: RawParams
    request_id: str = ""               # generated when empty
    owner: str = ""                    # who may abort it and whose ids it may not collide with
    priority: int = 0
    cache_salt: str = ""
    deadline: float | None = None      # event-loop time; None = none
    skip_special_tokens: bool = False
    authorization: str = ""            # the caller's bearer credential: its tenant (gateway.tenants)
    retention_s: float = 0.0           # pin the prompt's blocks this long after the request ends


def utf8_size(text: str) -> int:
    """UTF-8 bytes of ``text``, without a copy when it is ASCII (a flag CPython
    keeps): an oversized prompt must not cost another copy of itself to be refused."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


class Frontend:
    def __init__(self, engine, router, tokenizer, tenants: Tenants | None = None) -> None:
        self.engine = engine
        self.tenants = tenants or Tenants()
        self.router = router
        self.tokenizer = tokenizer
        # Tokenizing (and rendering chat templates) runs here, off the event loop
        # every stream shares: one thread, so the tokenizer is never used concurrently.
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    @property
    def caps(self) -> RequestCaps:
        return self.engine.config.caps

    def close(self) -> None:
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    def check_ready(self) -> None:
        if self.engine.fenced:
            raise Unavailable(failures.FENCED, retry_after_s=1.0)
        if not self.engine.ready:
            raise Unavailable("no executor is serving", retry_after_s=1.0)

    def check_text_bytes(self, size: int, param: str = "prompt") -> None:
        """A text prompt of ``size`` UTF-8 bytes may be tokenized (checked before any work)."""
        limits = self.engine.limits  # None before an executor joined (/tokenize still works)
        limit = self.caps.prompt_bytes(limits.prompt_token_limit if limits is not None else 0)
        if size > limit:
            raise InvalidArgument(f"the prompt text is {size} bytes; the limit is {limit} (max_prompt_bytes)",
                                  param=param)

    async def off_loop(self, fn: Callable, *args, **kwargs):
        """Run ``fn`` in the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Tokenize a text prompt, its size checked first."""
        self.check_text_bytes(len(text), param)  # a lower bound: no copy of a text too long in characters
        self.check_text_bytes(utf8_size(text), param)
        return await self.off_loop(lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def prompt_ids(self, text: str | None, token_ids: list[int] | None,
                         add_special_tokens: bool = True) -> list[int]:
        """Exactly one of text and token ids; ids are checked against the vocabulary."""
        if text and token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both", param="prompt")
        if token_ids:
            validate_token_ids(token_ids, self.engine.limits.vocab_size)
            return list(token_ids)
        if not text:
            raise InvalidArgument("prompt is empty", param="prompt")
        return await self.encode(text, add_special_tokens)

    def check_ids(self, request_id: str, cache_salt: str) -> None:
        caps = self.caps
        if len(request_id) > caps.max_request_id_chars or not request_id.isprintable():
            raise InvalidArgument(f"request_id must be at most {caps.max_request_id_chars} printable characters "
                                  "(max_request_id_chars)", param="request_id")
        salt = len(cache_salt.encode("utf-8", "surrogatepass"))
        if salt > caps.max_cache_salt_bytes:
            raise InvalidArgument(f"cache_salt is {salt} bytes; the limit is {caps.max_cache_salt_bytes} "
                                  "(max_cache_salt_bytes)", param="cache_salt")

    async def submit(self, sub: Submission) -> Request:
        """Validate and admit (nothing is allocated before every check passed)."""
        arrival_s = time.perf_counter()  # before routing: a slow prefix score is queue time too
        self.check_ready()
        engine = self.engine
        self.check_ids(sub.request_id, sub.cache_salt)
        spec = validate(sub.params, len(sub.prompt_ids), engine.limits)
        if not 0.0 <= sub.retention_s <= MAX_RETENTION_S:  # NaN fails too
            raise InvalidArgument(f"retention_s must be in [0, {MAX_RETENTION_S:g}] seconds", param="retention_s")
        request_id = sub.request_id or uuid.uuid4().hex
        tenant, salt = self.tenants.identify(sub.authorization, sub.cache_salt)
        chain = PromptChain(sub.prompt_ids, salt)  # block hashes: once, for routing and admission
        executor_id = await self.router.choose(sub.prompt_ids, salt, sub.deadline, chain)
        req = engine.new_request(request_id, sub.prompt_ids, spec, seed=spec.seed, priority=sub.priority,
                                 cache_salt=salt, deadline=sub.deadline,
                                 skip_special_tokens=sub.skip_special_tokens, chain=chain, arrival_s=arrival_s,
                                 owner=self.tenants.owner(sub.authorization) or sub.owner)
        req.tenant, req.retention_s = tenant, sub.retention_s
        await engine.submit(req, executor_id)
        return req

    def stream(self, req: Request) -> AsyncIterator[Output]:
        """The request's deltas; raises its error, if it ends with one."""
        return self.engine.stream(req)

    def release(self, req: Request) -> None:
        """The client is gone (or stopped reading): abort, its blocks are freed in the next step."""
        if not req.done:
            self.engine.abort(req.request_id, req.owner)
