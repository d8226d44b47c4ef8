"""What every client API does with one request: check, validate, route,
submit, stream, and abort it when its client goes away.

The gRPC servicer and the OpenAI-compatible HTTP layer both call this, so
the two accept the same requests with the same errors (domain errors; each
API maps them to its own statuses) and share one engine. No grpc here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvpager.errors import InvalidArgument, Unavailable
from kvpager.prefix_index.hashing import PromptChain
from gateway.params import RawParams, validate, validate_token_ids
from gateway.state import Output, Request


@dataclass(slots=True)
class Submission:
    """One request as an API hands it over (its prompt already in token ids)."""

    prompt_ids: list[int]
    params: RawParams
    request_id: str = ""               # generated when empty
    priority: int = 0
    cache_salt: str = ""
    deadline: float | None = None      # event-loop time; None = none
    skip_special_tokens: bool = False


class Frontend:
    def __init__(self, engine, router, tokenizer) -> None:
        self.engine = engine
        self.router = router
        self.tokenizer = tokenizer

    def check_ready(self) -> None:
        if not self.engine.ready:
            raise Unavailable("no executor is serving", retry_after_s=1.0)

    def prompt_ids(self, text: str | None, token_ids: list[int] | None,
                   add_special_tokens: bool = True) -> list[int]:
        """Exactly one of text and token ids; ids are checked against the vocabulary."""
        if text and token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both", param="prompt")
        if token_ids:
            validate_token_ids(token_ids, self.engine.limits.vocab_size)
            return list(token_ids)
        if not text:
            raise InvalidArgument("prompt is empty", param="prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def submit(self, sub: Submission) -> Request:
        """Validate and admit (nothing is allocated before every check passed)."""
        arrival_s = time.perf_counter()  # before routing: a slow prefix score is queue time too
        self.check_ready()
        engine = self.engine
        spec = validate(sub.params, len(sub.prompt_ids), engine.limits)
        request_id = sub.request_id or uuid.uuid4().hex
        chain = PromptChain(sub.prompt_ids, sub.cache_salt)  # block hashes: once, for routing and admission
        executor_id = await self.router.choose(sub.prompt_ids, sub.cache_salt, sub.deadline, chain)
        req = engine.new_request(request_id, sub.prompt_ids, spec, seed=spec.seed, priority=sub.priority,
                                 cache_salt=sub.cache_salt, deadline=sub.deadline,
                                 skip_special_tokens=sub.skip_special_tokens, chain=chain, arrival_s=arrival_s)
        await engine.submit(req, executor_id)
        return req

    def stream(self, req: Request) -> AsyncIterator[Output]:
        """The request's deltas; raises its error, if it ends with one."""
        return self.engine.stream(req)

    def release(self, req: Request) -> None:
        """The client is gone (or stopped reading): abort, its blocks are freed in the next step."""
        if not req.done:
            self.engine.abort(req.request_id)
