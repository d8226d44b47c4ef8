"""Client-facing gRPC: proto -> validated request -> engine -> streamed
responses. Thin: admission is gateway.frontend's (shared with the HTTP
API), validation gateway.params', scheduling the engine's."""

from __future__ import annotations

import asyncio
import uuid

import structlog

from kvpager.auth import principal
from kvpager.errors import Unavailable
from kvpager.interceptor import client_request_id
from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from gateway.frontend import Frontend, Submission
from gateway.params import RawParams
from gateway.state import Output


def raw_params(sp: common_pb2.SamplingParams) -> RawParams:
    """proto3 zeros mean unset: max_tokens 0 is the rest of the context, repetition_penalty 0 is off.
    Stop strings and ids stay the message's containers: validation counts them before copying."""
    return RawParams(max_tokens=sp.max_tokens or None, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                     seed=sp.seed if sp.HasField("seed") else None, n=sp.n, stop=sp.stop,
                     stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, beam_width=sp.beam_width,
                     length_penalty=sp.length_penalty, min_tokens=sp.min_tokens, logprobs=sp.logprobs,
                     top_logprobs=sp.top_logprobs, presence_penalty=sp.presence_penalty,
                     frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty or None,
                     min_p=sp.min_p, logit_bias=dict(sp.logit_bias))


def response(request_id: str, out: Output) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(request_id=request_id, index=out.index, token_ids=out.token_ids,
                                       text=out.text, finish_reason=int(out.finish), logprobs=out.logprobs,
                                       cumulative_logprob=out.cumulative_logprob)
    for top in out.top_logprobs:
        msg.top_logprobs.add(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
    if out.finish:
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        msg.usage.cached_prompt_tokens = out.cached_prompt_tokens
    return msg


def _authorization(context) -> str:
    """The call's bearer credential (its tenant, when it is a tenant's token)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else bytes(value).decode("latin-1")
    return ""


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, engine, router, tokenizer, *, token_required: bool = False, tenants=None) -> None:
        self.engine = engine
        self.frontend = Frontend(engine, router, tokenizer, tenants)
        self.token_required = token_required  # the caller's principal: see kvpager.auth.principal

    async def Generate(self, request, context):
        frontend = self.frontend
        # The client's id names the request everywhere (Abort, logs): the body's, else the header's.
        request_id = request.request_id or client_request_id(context.invocation_metadata()) or uuid.uuid4().hex
        frontend.check_ids(request_id, request.cache_salt)  # before it goes into any log line
        structlog.contextvars.bind_contextvars(request_id=request_id)
        frontend.check_ready()
        prompt_ids = await frontend.prompt_ids(request.prompt, list(request.prompt_token_ids))
        remaining = context.time_remaining()
        deadline = asyncio.get_running_loop().time() + remaining if remaining is not None else None
        params = raw_params(request.sampling_params)
        params.stream_interval = request.stream_interval
        req = await frontend.submit(Submission(prompt_ids, params,
                                               request_id=request_id,
                                               owner=principal(context, self.token_required),
                                               authorization=_authorization(context),
                                               retention_s=request.retention_s,
                                               priority=request.priority,
                                               cache_salt=request.cache_salt, deadline=deadline,
                                               skip_special_tokens=request.skip_special_tokens))
        try:
            async for out in frontend.stream(req):
                yield response(req.request_id, out)
        finally:  # client went away, or its deadline passed: free its blocks next step
            frontend.release(req)

    async def Abort(self, request, context):
        return gateway_pb2.AbortResponse(
            found=self.engine.abort(request.request_id, self.frontend.tenants.owner(_authorization(context))
                                    or principal(context, self.token_required)))

    async def GetModelInfo(self, request, context):
        engine = self.engine
        if engine.limits is None:
            raise Unavailable("no executor is serving yet", retry_after_s=1.0)
        block_sizes = {ex.block_size for ex in engine.executors.values()}
        return gateway_pb2.ModelInfo(model_id=engine.model_id, max_model_len=engine.limits.max_model_len,
                                     vocab_size=engine.limits.vocab_size, eos_token_ids=sorted(engine.eos_ids),
                                     num_executors=sum(1 for e in engine.executors.values() if e.alive),
                                     block_size=block_sizes.pop() if len(block_sizes) == 1 else 0,
                                     max_n=engine.config.max_n)
