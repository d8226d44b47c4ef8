"""Free loopback ports for local stacks, test servers and benchmarks."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_range(count: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """First of ``count`` consecutive ports free right now."""
    for _ in range(tries):
        base = free_port(host)
        if base + count > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no {count} consecutive free ports on {host}")
