"""Client side of the shared plumbing: channels with the servers' limits and
keepalive, TLS, bearer tokens, a readiness wait and an in-flight bound."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["BoundedCalls", "ClientTls", "auth_metadata", "bearer_interceptors", "channel_options", "make_channel",
           "wait_for_serving"]

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Servers accept a ping every 10 s (kvpager.server); 30 s stays well inside.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect within a second of a peer coming back (a restarted memory
        # service or executor); grpc's default backoff grows to 120 s, and
        # calls fail fast with UNAVAILABLE meanwhile.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class ClientTls:
    """Trust ``ca_file`` (None = system roots); present a client cert for mTLS."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None  # override the name checked against the cert

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")

        def read(path):
            return pathlib.Path(path).read_bytes() if path else None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file),
            private_key=read(self.key_file),
            certificate_chain=read(self.cert_file),
        )


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Per-call metadata for ``TokenAuth``: ``stub.M(req, metadata=auth_metadata(t))``."""
    return (("authorization", f"Bearer {token}"),)


class _Bearer:
    """Adds ``authorization: Bearer <token>`` to calls of one kind.

    An interceptor rather than ``grpc.access_token_call_credentials`` because
    call credentials are refused on insecure channels, and the embedded stack
    runs without TLS. One object per call kind: a grpc.aio channel files each
    interceptor under the *first* kind it is an instance of, so one object
    implementing all four silently skipped every streaming call.
    """

    def __init__(self, token: str) -> None:
        self._metadata = auth_metadata(token)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return details._replace(metadata=metadata)


class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def bearer_interceptors(token: str) -> list:
    """aio client interceptors sending ``token`` on every call, of every kind."""
    return [kind(token) for kind in (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary, _BearerStreamStream)]


def make_channel(
    address: str,
    *,
    tls: ClientTls | None = None,
    token: str | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    aio: bool = True,
    interceptors=(),
):
    """A channel to ``address`` ("host:port") with the servers' limits.

    Args:
        tls: TLS settings; insecure when None.
        token: bearer token sent on every call (aio: an interceptor; sync:
            only with TLS, as call credentials; otherwise pass
            ``metadata=auth_metadata(token)`` per call).
        aio: a ``grpc.aio.Channel`` (default) or a blocking ``grpc.Channel``.
        interceptors: extra aio client interceptors.
    """
    options = channel_options(max_message_bytes)
    if tls and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    credentials = tls.credentials() if tls else None
    if not aio:
        if token and credentials is None:
            raise ValueError("a sync insecure channel cannot carry a token; use auth_metadata(token) per call")
        if token:
            credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(token))
        if credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, credentials, options=options)
    interceptors = [*(bearer_interceptors(token) if token else []), *interceptors]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors or None)


async def wait_for_serving(
    address: str,
    timeout_s: float,
    service: str = "",
    *,
    tls: ClientTls | None = None,
    poll_s: float = 0.05,
) -> None:
    """Polls grpc.health.v1 Check until ``service`` is SERVING.

    Raises:
        TimeoutError: not SERVING within ``timeout_s``; says what was seen last.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with make_channel(address, tls=tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{address} health {service or '(server)'!r} not SERVING after {timeout_s:g}s (last: {last})"
                )
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=max(min(remaining, 1.0), 0.01)
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                last = f"{err.code().name}: {err.details()}"
            await asyncio.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))


class BoundedCalls:
    """Bounds in-flight calls on one channel: ``async with bound: await stub.M(...)``.

    HTTP/2 caps concurrent streams per connection anyway; this keeps the
    waiting on our side, where it is visible (``num_in_flight``) and cancellable.
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self._semaphore = asyncio.Semaphore(max_in_flight)
        self.num_in_flight = 0

    async def __aenter__(self) -> BoundedCalls:
        await self._semaphore.acquire()
        self.num_in_flight += 1
        return self

    async def __aexit__(self, *_exc) -> None:
        self.num_in_flight -= 1
        self._semaphore.release()
