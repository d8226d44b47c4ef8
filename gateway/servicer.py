"""Client-facing gRPC: proto -> validated request -> engine -> streamed
responses. Thin: validation lives in gateway.params, scheduling in the engine."""

from __future__ import annotations

import asyncio
import uuid

from kvpager.errors import InvalidArgument, Unavailable
from kvpager.prefix_index.hashing import PromptChain
from kvpager.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from gateway.params import RawParams, validate, validate_token_ids
from gateway.state import Output


def raw_params(sp: common_pb2.SamplingParams) -> RawParams:
    return RawParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                     seed=sp.seed if sp.HasField("seed") else None, n=sp.n, stop=list(sp.stop),
                     stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos, beam_width=sp.beam_width,
                     length_penalty=sp.length_penalty, min_tokens=sp.min_tokens, logprobs=sp.logprobs)


def response(request_id: str, out: Output) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(request_id=request_id, index=out.index, token_ids=out.token_ids,
                                       text=out.text, finish_reason=int(out.finish), logprobs=out.logprobs,
                                       cumulative_logprob=out.cumulative_logprob)
    if out.finish:
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        msg.usage.cached_prompt_tokens = out.cached_prompt_tokens
    return msg


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, engine, router, tokenizer, max_request_tokens: int = 0) -> None:
        self.engine = engine
        self.router = router
        self.tokenizer = tokenizer

    def _prompt_ids(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both")
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            validate_token_ids(ids, self.engine.limits.vocab_size)
            return ids
        if not request.prompt:
            raise InvalidArgument("prompt is empty")
        return list(self.tokenizer.encode(request.prompt))

    async def Generate(self, request, context):
        engine = self.engine
        if not engine.ready:
            raise Unavailable("no executor is serving", retry_after_s=1.0)
        prompt_ids = self._prompt_ids(request)
        spec = validate(raw_params(request.sampling_params), len(prompt_ids), engine.limits)
        remaining = context.time_remaining()
        deadline = asyncio.get_running_loop().time() + remaining if remaining is not None else None
        request_id = request.request_id or uuid.uuid4().hex
        chain = PromptChain(prompt_ids, request.cache_salt)  # block hashes: once, for routing and admission
        executor_id = await self.router.choose(prompt_ids, request.cache_salt, deadline, chain)
        req = engine.new_request(request_id, prompt_ids, spec, seed=spec.seed, priority=request.priority,
                                 cache_salt=request.cache_salt, deadline=deadline,
                                 skip_special_tokens=request.skip_special_tokens, chain=chain)
        await engine.submit(req, executor_id)
        try:
            async for out in engine.stream(req):
                yield response(request_id, out)
        finally:
            if not req.done:  # client went away, or its deadline passed: free its blocks next step
                engine.abort(request_id)

    async def Abort(self, request, context):
        return gateway_pb2.AbortResponse(found=self.engine.abort(request.request_id))

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
