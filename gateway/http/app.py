"""The OpenAI-compatible routes (docs/api.md is the reference).

Thin, like the gRPC servicer: a body becomes a typed request
(``protocol``), each prompt a ``Submission`` that ``gateway.frontend``
validates and admits, and the engine's outputs become OpenAI bodies
(``render``), streamed or collected by responses that abort their requests
when the client disconnects (``streams``). Every prompt of a request is
validated before any is admitted, so a bad one leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import uuid
from collections import defaultdict
from collections.abc import Callable

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import failures, metrics
from gateway.frontend import Frontend, Submission, utf8_size
from gateway.http import protocol
from gateway.http.chat import ChatTemplate
from gateway.http.errors import HttpError, bad_request, from_domain, model_not_found
from gateway.http.render import Renderer, TokenText, Usage
from gateway.http.streams import DONE, Deferred, EventStream, event, merged
from gateway.params import validate, validate_token_ids
from kvpager.errors import KvpagerError
from kvpager.telemetry import get_logger

log = get_logger("gateway.http")

ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
          "/metrics", "/version")
# Completions name the alternatives "logprobs"; the shared validation calls them top_logprobs.
_COMPLETION_PARAMS = {"top_logprobs": "logprobs"}


@dataclasses.dataclass
class HttpContext:
    """What the routes need from the gateway."""

    frontend: Frontend
    chat: ChatTemplate
    served_model_name: str
    model_dir: str
    version: str
    api_keys: tuple[str, ...] = ()          # accepted bearer tokens; empty = open
    max_body_bytes: int = 16 * 2**20
    serving: Callable[[], bool] = lambda: True
    created: int = 0


async def read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"the request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128


def request_id_of(request: Request, common: protocol.Common, limit: int = MAX_REQUEST_ID) -> str:
    """The client's id for the request: the body's ``request_id``, else the
    ``X-Request-Id`` header, else a fresh one. It names the request in the
    engine (``Abort``), in every log line and in the response (``id``, header).
    ``limit``: the gateway's ``--max-request-id-chars``."""
    rid = common.request_id or request.headers.get(REQUEST_ID_HEADER, "") or uuid.uuid4().hex
    if len(rid) > limit or not rid.isprintable() or not rid.isascii():
        raise bad_request(f"request_id must be at most {limit} printable ASCII characters (max_request_id_chars)",
                          "request_id")
    request.state.request_id = rid
    structlog.contextvars.bind_contextvars(request_id=rid)
    return rid


def owner_of(request: Request, keyed: bool) -> str:
    """Who owns an HTTP request's requests (kvpager.auth.principal's rule):
    with API keys required (``keyed``) every holder is one principal, the same
    as gRPC's with the token; without, the connection."""
    if keyed:
        return "token/"
    client = request.client
    return f"conn/http:{client.host}:{client.port}" if client is not None else "conn/http"


class _CountRequests:
    """ASGI middleware: kvpager_gateway_http_requests_total by route and status;
    echoes the request's id (``request_id_of``) as ``X-Request-Id``."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                rid = scope.get("state", {}).get("request_id")
                if rid:
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(message)

        try:  # uvicorn runs each request in its own task: request_id_of's binding ends with it
            await self.app(scope, receive, counted)
        finally:
            path = scope.get("path", "")
            metrics.HTTP_REQUESTS.labels(path if path in ROUTES else "other", str(status)).inc()


def make_app(ctx: HttpContext) -> FastAPI:
    app = FastAPI(title="kvpager", version=ctx.version, openapi_url=None, docs_url=None, redoc_url=None)
    frontend, chat = ctx.frontend, ctx.chat
    tokenizer = frontend.tokenizer
    token_text = TokenText(tokenizer)
    keys = tuple(f"Bearer {k}".encode() for k in ctx.api_keys)

    def authorize(request: Request) -> None:
        if not keys:
            return
        given = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(given, k) for k in keys):
            raise HttpError(401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != ctx.served_model_name:
            raise model_not_found(name)

    async def encode_chat(messages: list[dict], add_generation_prompt: bool, **kwargs) -> list[int]:
        """Render and tokenize off the loop, the text's size checked before each."""
        frontend.check_text_bytes(sum(utf8_size(str(m.get("content") or "")) for m in messages), "messages")
        text = await frontend.off_loop(chat.render, messages, add_generation_prompt,
                                       **{k: v for k, v in kwargs.items() if k != "add_special_tokens"})
        return await frontend.encode(text, kwargs.get("add_special_tokens", False), param="messages")

    async def admit(subs: list[Submission]) -> list:
        """Validate every prompt, then admit them all (or none)."""
        limits = frontend.engine.limits
        for sub in subs:
            validate(sub.params, len(sub.prompt_ids), limits)
        reqs = []
        try:
            for sub in subs:
                reqs.append(await frontend.submit(sub))
        except BaseException:
            for req in reqs:
                frontend.release(req)
            raise
        return reqs

    def close(reqs: list) -> Callable[[], None]:
        def release() -> None:
            for req in reqs:
                frontend.release(req)
        return release

    async def generate(common: protocol.Common, prompt_ids: list[list[int]], renderer: Renderer,
                       prefixes: dict[int, str], request_id: str, owner: str, authorization: str = "") -> Response:
        # One prompt: the client's id itself (so Abort and the logs find it); several: id-0, id-1, ...
        ids_of = [request_id] if len(prompt_ids) == 1 else [f"{request_id}-{i}" for i in range(len(prompt_ids))]
        subs = [Submission(ids, common.params, request_id=ids_of[i], owner=owner, authorization=authorization,
                           priority=common.priority, retention_s=common.retention_s,
                           cache_salt=common.cache_salt, skip_special_tokens=common.skip_special_tokens)
                for i, ids in enumerate(prompt_ids)]
        reqs = await admit(subs)
        streams = [frontend.stream(r) for r in reqs]
        if common.stream:
            return EventStream(_events(renderer, streams, common.include_usage, dict(prefixes), len(reqs)),
                               close(reqs))
        return Deferred(lambda: _collect(renderer, streams, prefixes), close(reqs))

    # ---- the API ------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        authorize(request)
        check_model(name)
        return model_card()

    def model_card() -> dict:
        limits = frontend.engine.limits
        return {"id": ctx.served_model_name, "object": "model", "created": ctx.created, "owned_by": "kvpager",
                "root": ctx.model_dir, "parent": None,
                "max_model_len": limits.max_model_len if limits is not None else None}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = protocol.completion_request(await read_json(request, ctx.max_body_bytes))
        check_model(req.common.model)
        frontend.check_ready()
        rid = request_id_of(request, req.common, frontend.caps.max_request_id_chars)
        try:
            frontend.check_text_bytes(sum(utf8_size(p) for p in req.prompts if isinstance(p, str)))  # together
            ids = [await frontend.prompt_ids(p, None) if isinstance(p, str) else await frontend.prompt_ids(None, p)
                   for p in req.prompts]
            n = req.common.params.n
            renderer = Renderer(False, ctx.served_model_name, token_text, n, rid)
            prefixes = {}
            if req.echo:
                for i, p in enumerate(req.prompts):
                    text = p if isinstance(p, str) else tokenizer.decode(p)
                    prefixes.update({i * n + j: text for j in range(n)})
            return await generate(req.common, ids, renderer, prefixes, rid, owner_of(request, bool(keys)),
                                  request.headers.get("authorization", ""))
        except KvpagerError as exc:
            if exc.param in _COMPLETION_PARAMS:
                exc.param = _COMPLETION_PARAMS[exc.param]
            raise

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = protocol.chat_request(await read_json(request, ctx.max_body_bytes))
        check_model(req.common.model)
        frontend.check_ready()
        rid = request_id_of(request, req.common, frontend.caps.max_request_id_chars)
        ids = await encode_chat(req.messages, req.add_generation_prompt, **req.template_kwargs)
        renderer = Renderer(True, ctx.served_model_name, token_text, req.common.params.n, rid)
        return await generate(req.common, [ids], renderer, {}, rid, owner_of(request, bool(keys)),
                              request.headers.get("authorization", ""))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        t = protocol.tokenize_request(await read_json(request, ctx.max_body_bytes))
        check_model(t.model)
        if t.messages is not None:
            ids = await encode_chat(t.messages, t.add_generation_prompt, add_special_tokens=t.add_special_tokens)
        else:
            ids = await frontend.encode(t.prompt, add_special_tokens=t.add_special_tokens)
        limits = frontend.engine.limits
        return {"count": len(ids), "max_model_len": limits.max_model_len if limits is not None else None,
                "tokens": ids, "token_strs": tokenizer.convert_ids_to_tokens(ids) if t.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        name, ids = protocol.detokenize_request(await read_json(request, ctx.max_body_bytes))
        check_model(name)
        limits = frontend.engine.limits
        try:
            validate_token_ids(ids, limits.vocab_size if limits is not None else len(tokenizer))
        except KvpagerError as exc:
            exc.param = "tokens"
            raise
        return {"prompt": tokenizer.decode(ids)}

    # ---- operations --------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if ctx.serving() and frontend.engine.ready:
            return Response(status_code=200)
        why = failures.FENCED if frontend.engine.fenced else "no executor, or shutting down"
        return JSONResponse(HttpError(503, f"not serving: {why}", type="server_error",
                                      code="service_unavailable").body(), status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": ctx.version}

    # ---- errors -------------------------------------------------------------------------------

    def error_response(err: HttpError) -> JSONResponse:
        if err.status != 404:
            log.info("http request failed", status=err.status, error=err.message)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(HttpError)
    async def on_http_error(request: Request, exc: HttpError):
        return error_response(exc)

    @app.exception_handler(KvpagerError)
    async def on_domain_error(request: Request, exc: KvpagerError):
        return error_response(from_domain(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_route_error(request: Request, exc: StarletteHTTPException):
        return error_response(HttpError(exc.status_code, str(exc.detail), code="not_found"
                                        if exc.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):
        log.error("http request failed", path=request.url.path, error=repr(exc))
        return error_response(HttpError(500, "internal error", type="server_error", code="internal_error"))

    app.add_middleware(_CountRequests)
    return app


async def _events(renderer: Renderer, streams: list, include_usage: bool, prefixes: dict[int, str],
                  num_prompts: int):
    """The SSE body: chat's first delta per choice carries the role; then one
    chunk per step with new tokens (its text may be empty: held back while it
    might become a stop string or a multi-byte character, or special tokens
    skipped); each choice's last chunk its finish_reason; a usage chunk when
    asked; [DONE]."""
    usage = Usage()
    first = True
    async for i, out in merged(streams):
        if first and renderer.chat:  # after the first output: an error before it is a real status
            for index in range(num_prompts * renderer.n):
                yield event(renderer.chunk([renderer.role_choice(index)], include_usage))
        first = False
        index = renderer.index(i, out)
        choice = renderer.stream_choice(index, out, prefixes.pop(index, ""))
        usage.add(i, out)
        if not out.token_ids and choice["finish_reason"] is None:
            continue  # no new token (as vLLM: a token whose text is held back still gets its chunk)
        yield event(renderer.chunk([choice], include_usage))
    if include_usage:
        yield event(renderer.usage_chunk(usage))
    yield DONE


async def _collect(renderer: Renderer, streams: list, prefixes: dict[int, str]) -> dict:
    usage = Usage()
    choices: dict[int, list] = defaultdict(list)
    async for i, out in merged(streams):
        choices[renderer.index(i, out)].append(out)
        usage.add(i, out)
    return renderer.response(choices, usage, prefixes)
