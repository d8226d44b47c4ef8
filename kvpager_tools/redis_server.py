"""A throwaway redis-server on a loopback port (tests, drills and the mirror benchmark).

No persistence (`--save '' --appendonly no`), its own temp dir, stopped by
PID. `kill()` is a SIGKILL (a crash); `restart()` brings a fresh, empty server
back on the same port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from kvpager_tools.ports import free_port


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    return "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None


class RedisServer:
    """One redis-server process.

    Args:
        extra_args: more server options, e.g. ("--requirepass", "pw") or
            ("--user", "alice", "on", ">pw", "~*", "+@all").
        url_auth: "user:pass@" or ":pass@" put into `url`.
    """

    def __init__(self, port: int | None = None, *, extra_args: tuple[str, ...] = (), url_auth: str = "",
                 host: str = "127.0.0.1", binary: str | None = None) -> None:
        self.binary = binary or redis_server_binary()
        if self.binary is None:
            raise FileNotFoundError("redis-server not found (install redis-server)")
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = tuple(extra_args)
        self.url_auth = url_auth
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvpager-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.url_auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                "--dir", self._dir.name, "--daemonize", "no", "--loglevel", "warning", *self.extra_args]
        # Its own session: a terminal's Ctrl-C reaches the owner, which stops it.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on port {self.port} did not answer PING in {timeout_s:g}s")
            time.sleep(0.01)
        return self

    def _answers(self) -> bool:
        """PING answered (+PONG, or -NOAUTH when a password is required)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))

    def dbsize(self) -> int | None:
        """Number of keys (None when not answering)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=1.0) as s:
                s.sendall(b"DBSIZE\r\n")
                reply = s.recv(64)
            return int(reply[1:].split(b"\r\n")[0]) if reply.startswith(b":") else None
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL by PID and reap it (a crash: nothing is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._close_pipes()

    def stop(self) -> None:
        """SIGTERM by PID; SIGKILL if it does not exit within 5 s."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def restart(self, timeout_s: float = 10.0) -> RedisServer:
        """Kill -9 and start an empty server on the same port."""
        self.kill()
        return self.start(timeout_s)

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def _close_pipes(self) -> None:
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.close()
