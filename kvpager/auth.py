"""Bearer-token authentication for the gRPC services.

One shared secret per deployment, sent by clients as ``authorization: Bearer
<token>`` (see ``kvpager.channel``). Health and reflection are always open so
probes and grpcurl work without the secret; a service may open more methods
(e.g. read-only accounting) by full method name.
"""

from __future__ import annotations

import hmac

import grpc
import grpc.aio

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = (
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
_ALWAYS_OPEN = (HEALTH_PREFIX, *REFLECTION_PREFIXES)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Rejects calls without the right bearer token with UNAUTHENTICATED.

    Args:
        token: the shared secret (may be empty when ``also`` holds tokens).
        open_methods: full method names ("/kvpager.v1.MemoryService/GetAccounting")
            that need no token.
        also: more full-access tokens (the gateway's tenant tokens).
        read_only_token: a second secret accepted (besides ``token``) on
            ``read_only_methods`` only: an operator's view that cannot mutate.
        read_only_methods: the methods ``read_only_token`` opens.
    """

    def __init__(self, token: str, open_methods: frozenset[str] = frozenset(), also: tuple[str, ...] = (), *,
                 read_only_token: str | None = None, read_only_methods: frozenset[str] = frozenset()) -> None:
        tokens = [t for t in (token, *also) if t]
        if not tokens:
            raise ValueError("TokenAuth needs a non-empty token")
        if read_only_token is not None and (not read_only_token or read_only_token in tokens):
            raise ValueError("the read-only token must be non-empty and differ from the admin token (and every tenant token)")
        self._expected = tuple(_bearer(t) for t in tokens)  # ``also``: more accepted (tenants')
        self._read_only = _bearer(read_only_token) if read_only_token else None
        self.open_methods = frozenset(open_methods)
        self.read_only_methods = frozenset(read_only_methods)

    def is_open(self, method: str) -> bool:
        return method in self.open_methods or method.startswith(_ALWAYS_OPEN)

    def is_authorized(self, metadata, method: str = "") -> bool:
        """Whether the call's ``authorization`` carries the token ``method`` needs."""
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                # Constant time, and against every token, so the comparison leaks nothing about a secret.
                ok = False
                for expected in self._expected:
                    ok |= hmac.compare_digest(given, expected)
                if ok:
                    return True
                return (self._read_only is not None and method in self.read_only_methods
                        and hmac.compare_digest(given, self._read_only))
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or self.is_open(method):
            return handler
        if self.is_authorized(handler_call_details.invocation_metadata, method):
            return handler
        return _rejecting(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


def _bearer(token: str) -> bytes:
    return f"Bearer {token}".encode()


def _rejecting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only aborts.

    An aio server interceptor cannot abort by itself (it has no context): it
    must hand back a handler, and that handler's kind decides how grpc drives
    it, so the kind has to match the method's.
    """

    async def abort_unary(_request, context):
        await context.abort(code, details)

    async def abort_stream(_request, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    # kvpager.server answers a malformed request INVALID_ARGUMENT, except to a
    # call this handler rejects (auth first).
    abort_unary.kvpager_rejects = abort_stream.kvpager_rejects = True
    kwargs = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort_unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort_unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **kwargs)


def principal(context: grpc.aio.ServicerContext, token_required: bool) -> str:
    """Who is calling, for scoping what a call may touch (its own requests).

    The bearer token is one shared secret, so with ``token_required`` every
    holder is the same principal, told apart further only by a verified TLS
    client certificate. Without a token a certificate is the principal; with
    neither, the connection is (``context.peer()``: one HTTP/2 connection, as
    a channel keeps it).
    """
    identity = ""
    try:
        names = context.peer_identities()
    except Exception:  # noqa: BLE001 - no TLS on this call
        names = None
    if names:
        identity = b",".join(names).decode("utf-8", "replace")
    if token_required:
        return f"token/{identity}"
    if identity:
        return f"tls/{identity}"
    return f"conn/{context.peer()}"
