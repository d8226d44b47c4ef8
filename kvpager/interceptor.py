"""The one server interceptor: domain errors become status codes here, and
every call gets its request id, structured-log context and RPC metrics.

Also where a request whose bytes do not parse becomes INVALID_ARGUMENT
(grpc itself would answer UNKNOWN).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Callable

import grpc
import grpc.aio
import structlog

from kvpager.errors import InvalidArgument, KvpagerError
from kvpager.log_limits import clip
from kvpager.telemetry import RpcMetrics, get_logger, rpc_metrics

log = get_logger("kvpager.server")

REQUEST_ID_KEY = "x-request-id"
RETRY_AFTER_KEY = "retry-after-s"
INTERNAL_DETAILS = "internal error"


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the handler
    wrapper can answer INVALID_ARGUMENT (grpc itself would answer UNKNOWN)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError, ...: all malformed input
            return _Malformed(type(exc).__name__)

    return deserialize


def _check_parsed(request, behavior: Callable) -> None:
    # An auth rejection still wins over "malformed": unauthenticated callers
    # learn nothing about the method.
    if isinstance(request, _Malformed) and not getattr(behavior, "kvpager_rejects", False):
        raise InvalidArgument(f"malformed request: the message does not parse ({request.error})")


def _checked(request, behavior: Callable, streamed: bool):
    """The request (or, for client streaming, an iterator over requests) with
    unparsable messages turned into INVALID_ARGUMENT."""
    if not streamed:
        _check_parsed(request, behavior)
        return request

    async def each():
        async for item in request:
            _check_parsed(item, behavior)
            yield item

    return each()


_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", grpc.stream_stream_rpc_method_handler),
)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """The one place domain errors become status codes; also request ids and
    RPC metrics.

    * ``KvpagerError`` -> ``grpc.StatusCode[err.status]`` with its message, and
      trailing ``retry-after-s`` when ``err.retry_after_s`` is set;
    * any other exception -> INTERNAL with a generic message (logged with its
      traceback here, never sent);
    * a request whose bytes do not parse -> INVALID_ARGUMENT (not grpc's
      UNKNOWN), unless authentication rejects the call first;
    * ``x-request-id`` is taken from the call or generated, bound into structlog
      contextvars for the call, and sent back as initial metadata (so handlers
      must not send initial metadata themselves) — except on the methods in
      ``trailing_id_methods`` (full names, "/pkg.Service/Method"): the
      per-step RPCs of the internal data path, called every step, send it in
      their trailing metadata instead. Initial metadata of its own is one more
      batch operation per call (~0.1 ms each side on a 2-core machine);
      trailing metadata goes with the status.
    """

    def __init__(self, service: str, trailing_id_methods: frozenset[str] = frozenset()) -> None:
        self.service = service
        self.trailing_id_methods = frozenset(trailing_id_methods)
        self.metrics = rpc_metrics(service)  # in the service's own registry

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        request_id = _request_id(handler_call_details.invocation_metadata)
        # An aio interceptor cannot wrap "the call": it must return a new
        # handler of the same kind, and grpc picks how to drive the behavior
        # (await it, or iterate it) from whether it is a coroutine function or
        # an async generator function.
        for kind, make in _HANDLER_KINDS:
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrap = self._wrap_stream if kind.endswith("_stream") else self._wrap_unary
                return make(
                    wrap(behavior, method, request_id, kind.startswith("stream_")),
                    request_deserializer=_tolerant(handler.request_deserializer),
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _wrap_unary(self, behavior: Callable, method: str, request_id: str, streamed: bool):
        trailing_id = method in self.trailing_id_methods

        async def unary(request, context):
            with _Call(self.metrics, self.service, method, request_id) as call:
                if trailing_id:  # sent with the status, also when the call fails (Call.fail keeps it)
                    context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
                else:
                    await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
                try:
                    result = behavior(_checked(request, behavior, streamed), context)
                    if inspect.isawaitable(result):
                        result = await result
                except BaseException as exc:  # noqa: BLE001 - classified, then re-raised or aborted
                    await call.fail(exc, context)
                call.code = _code_name(context)
                return result

        return unary

    def _wrap_stream(self, behavior: Callable, method: str, request_id: str, streamed: bool):
        trailing_id = method in self.trailing_id_methods

        async def stream(request, context):
            with _Call(self.metrics, self.service, method, request_id) as call:
                if trailing_id:  # as unary: no separate metadata send before the first message
                    context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
                else:
                    await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
                try:
                    result = behavior(_checked(request, behavior, streamed), context)
                    if hasattr(result, "__aiter__"):
                        async for response in result:
                            yield response
                    elif inspect.isawaitable(result):  # writer API: context.write(), returns None
                        await result
                    elif result is not None:  # a plain iterator
                        for response in result:
                            yield response
                except BaseException as exc:  # noqa: BLE001
                    await call.fail(exc, context)
                call.code = _code_name(context)

        return stream


class _Call:
    """One RPC's bookkeeping: contextvars, in-flight gauge, latency, final code."""

    def __init__(self, metrics: RpcMetrics, service: str, method: str, request_id: str) -> None:
        self.metrics = metrics
        self.service, self.method, self.request_id = service, method, request_id
        self.code = "UNKNOWN"

    def __enter__(self) -> _Call:
        self._start = time.perf_counter()
        self._bound = structlog.contextvars.bound_contextvars(
            request_id=self.request_id, method=self.method, service=self.service
        )
        self._bound.__enter__()
        self.metrics.in_flight.labels(self.service, self.method).inc()
        return self

    def __exit__(self, *_exc) -> None:
        m = self.metrics
        m.in_flight.labels(self.service, self.method).dec()
        m.latency.labels(self.service, self.method).observe(time.perf_counter() - self._start)
        m.requests.labels(self.service, self.method, self.code).inc()
        self._bound.__exit__(None, None, None)

    async def fail(self, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        """Re-raises ``exc`` or turns it into an abort; never returns."""
        if isinstance(exc, grpc.aio.AbortError):  # the handler aborted itself: already sent
            self.code = _code_name(context, default="UNKNOWN")
            raise exc
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            self.code = "CANCELLED"
            raise exc
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
            raise exc
        if isinstance(exc, KvpagerError) and exc.status in grpc.StatusCode.__members__ and exc.status != "OK":
            code, details = grpc.StatusCode[exc.status], exc.message
            log.info("rpc failed", code=exc.status, error=clip(details, 400))
        elif isinstance(exc, NotImplementedError):  # the generated base servicer's stubs
            code, details = grpc.StatusCode.UNIMPLEMENTED, "method not implemented"
        else:
            code, details = grpc.StatusCode.INTERNAL, INTERNAL_DETAILS
            log.error("rpc raised", exc_info=exc)
        trailing = tuple(context.trailing_metadata() or ())
        if isinstance(exc, KvpagerError) and exc.retry_after_s is not None:
            trailing += ((RETRY_AFTER_KEY, f"{exc.retry_after_s:g}"),)
        self.code = code.name
        await context.abort(code, details, trailing)


def client_request_id(metadata) -> str | None:
    """The caller's ``x-request-id`` if it sent a sane one."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and isinstance(value, str) and 0 < len(value) <= 128 and value.isprintable():
            return value
    return None


def _request_id(metadata) -> str:
    """The caller's ``x-request-id`` if it is a sane token, else a fresh one."""
    return client_request_id(metadata) or uuid.uuid4().hex


def _code_name(context: grpc.aio.ServicerContext, default: str = "OK") -> str:
    """The status the handler set (set_code or abort), by name."""
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else default
