"""A real redis-server per test on a free loopback port, started and stopped
by PID (no mocks of Redis). Tests skip, saying why, when redis-server is absent."""

from __future__ import annotations

import pytest

from kvpager_tools.redis_server import RedisServer, redis_server_binary


def _binary() -> str:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server): the mirror tests need a real one")
    return binary


@pytest.fixture
def redis_factory():
    """make(extra_args=(), url_auth="") -> a started RedisServer; all stopped at teardown.

    Each process has .url, .kill() (SIGKILL by PID), .start() (same port) and
    .restart() (kill -9, then a fresh empty server on the same port)."""
    procs: list[RedisServer] = []

    def make(extra_args: tuple[str, ...] = (), url_auth: str = "") -> RedisServer:
        proc = RedisServer(extra_args=extra_args, url_auth=url_auth, binary=_binary())
        procs.append(proc)
        return proc.start()

    yield make
    for proc in procs:
        proc.close()


@pytest.fixture
def redis_proc(redis_factory) -> RedisServer:
    return redis_factory()
