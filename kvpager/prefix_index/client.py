"""Redis clients for the mirror: redis-py's own reconnect machinery (Retry with
exponential backoff on connection errors and timeouts, idle health checks),
short socket timeouts so a slow Redis shows up as an error, not a hang."""

from __future__ import annotations

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from kvpager.prefix_index.keys import redis_kwargs

_RETRIED = (RedisConnectionError, RedisTimeoutError)


def _options(username, password, socket_timeout_s: float, retries: int, health_check_interval_s: int) -> dict:
    return dict(
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        health_check_interval=health_check_interval_s,
        decode_responses=False,
        **redis_kwargs(username, password),
    ), retries


def make_async_client(url: str, *, username: str | None = None, password: str | None = None,
                      socket_timeout_s: float = 2.0, retries: int = 2, health_check_interval_s: int = 10,
                      single_connection: bool = False) -> redis.asyncio.Redis:
    """An asyncio client for ``url`` (redis://[user:pass@]host:port/db, rediss://, unix://).

    single_connection: one connection behind a lock instead of a pool (the
    writer: one task, calls in order, less per-call overhead)."""
    opts, retries = _options(username, password, socket_timeout_s, retries, health_check_interval_s)
    retry = AsyncRetry(ExponentialBackoff(cap=0.5, base=0.02), retries, supported_errors=_RETRIED)
    return redis.asyncio.Redis.from_url(url, retry=retry, retry_on_error=list(_RETRIED),
                                        single_connection_client=single_connection, **opts)


def make_client(url: str, *, username: str | None = None, password: str | None = None,
                socket_timeout_s: float = 2.0, retries: int = 2, health_check_interval_s: int = 10) -> redis.Redis:
    """The blocking twin of make_async_client (routers without an event loop)."""
    opts, retries = _options(username, password, socket_timeout_s, retries, health_check_interval_s)
    retry = Retry(ExponentialBackoff(cap=0.5, base=0.02), retries, supported_errors=_RETRIED)
    return redis.Redis.from_url(url, retry=retry, retry_on_error=list(_RETRIED), **opts)
