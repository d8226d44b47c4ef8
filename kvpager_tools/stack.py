"""`kvpager up`: the whole stack as local child processes on loopback.

The embedded default: one memory service (in-memory index, no Redis unless
``--redis-url``), N executors on the demo model (built once) on CPU, and the
gateway. Each child is a plain ``kvpager <service>`` process whose output goes
to a log file; ``Stack`` starts them in dependency order (memory, then the
executors, which register with it, then the gateway), waits for each one's
grpc.health.v1 SERVING, and stops them in reverse order (SIGTERM, a grace
period, then SIGKILL). Tests, benchmarks and drills use ``Stack`` directly::

    with Stack(StackConfig(num_executors=2).on_free_ports()) as stack:
        stack.addresses.gateway   # "127.0.0.1:PORT"
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# Re-exported: the stack's description lives in stack_config, the in-process variant in inprocess.
from kvpager_tools.inprocess import InProcessStack, start_in_process
from kvpager_tools.stack_config import (
    DEMO_NUM_BLOCKS,
    ENTRY_POINTS,
    ROLES,
    ChildSpec,
    StackAddresses,
    StackConfig,
    StackOptions,
    _join,
    build_children,
    cpu_executor_env,
)

__all__ = ["DEMO_NUM_BLOCKS", "ENTRY_POINTS", "ROLES", "ChildSpec", "InProcessStack", "Stack", "StackAddresses",
           "StackConfig", "StackError", "StackOptions", "build_children", "cpu_executor_env", "start_in_process",
           "wait_routed"]


class StackError(RuntimeError):
    """A child died or never became SERVING during start-up."""

    def __init__(self, child: str, reason: str, log_path: Path | None, log_tail: str, *,
                 usage: bool = False) -> None:
        super().__init__(f"{child}: {reason}")
        self.child, self.reason, self.log_path, self.log_tail = child, reason, log_path, log_tail
        self.usage = usage  # the operator's input is wrong (a port in use): `kvpager up` exits 2


async def wait_routed(gateway_address: str, num_executors: int, *, tls=None, token: str | None = None,
                      timeout_s: float = 60.0, check=None) -> None:
    """Until the gateway at ``gateway_address`` routes to ``num_executors``
    executors (GetModelInfo); ``check()``, when given, runs every round and
    may raise (a child died). Raises TimeoutError."""
    import asyncio

    import grpc

    from kvpager.channel import make_channel
    from kvpager.v1 import gateway_pb2, gateway_pb2_grpc

    deadline = time.monotonic() + timeout_s
    seen = 0
    async with make_channel(gateway_address, tls=tls, token=token) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        while True:
            if check is not None:
                check()
            try:
                seen = (await stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)).num_executors
                if seen >= num_executors:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway routes to {seen} of {num_executors} executors after {timeout_s:g}s")
            await asyncio.sleep(0.1)


def _die_with_parent() -> None:
    # SIGTERM this process if the thread that started it dies (a SIGKILLed
    # `kvpager up` leaves no orphans). Linux only.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# `python -c _BOOT -m MODULE ARGS...`: the child sets its parent-death signal
# itself, after exec, then runs MODULE as `python -m` would. Not a preexec_fn:
# Python code between fork and exec is unsafe once the parent has threads
# (gRPC's), and restarted children died there with SIGSEGV.
_BOOT = """\
import os, runpy, sys
from kvpager_tools.stack import _die_with_parent
_die_with_parent()
if os.getppid() != int(os.environ.pop("KVPAGER_PARENT_PID", "0") or os.getppid()):
    sys.exit(0)  # the parent died before the signal was armed
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    if len(argv) >= 3 and argv[1] == "-m":
        return [argv[0], "-c", _BOOT, *argv[1:]]
    return argv


def _tail(path: Path, num_lines: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


class Stack:
    """Starts, watches and stops the children of one local stack.

    ``start()`` blocks until every service is SERVING or raises ``StackError``
    (after stopping whatever it had started); ``stop()`` is idempotent. The
    children run in their own session, so a terminal's Ctrl-C reaches only the
    caller, which then stops them in order; with ``die_with_parent`` they also
    get SIGTERM when the *thread* that called ``start`` exits. ``start`` runs
    its own event loop: call it from synchronous code (or a worker thread
    that outlives the stack), not from inside a running loop.
    """

    def __init__(self, config: StackConfig, *, die_with_parent: bool = True) -> None:
        self.config = config
        self.die_with_parent = die_with_parent
        self.log_dir: Path | None = None
        self.children: list[ChildSpec] = []
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def addresses(self) -> StackAddresses:
        by_role = {role: [c for c in self.children if c.role == role] for role in ROLES}
        if not self.children:
            raise RuntimeError("not started")
        return StackAddresses(
            memory=by_role["memory"][0].address,
            gateway=by_role["gateway"][0].address,
            executors=tuple(c.address for c in by_role["executor"]),
            metrics={c.name: c.metrics_port for c in self.children if c.metrics_port is not None},
            http=self.http_url,
            blockmap=self._url(self.config.blockmap_port, "/"),
        )

    @property
    def http_url(self) -> str | None:
        """The gateway's HTTP API base URL, None when it has none."""
        return self._url(self.config.http_port)

    def _url(self, port: int | None, path: str = "") -> str | None:
        config = self.config
        if port is None:
            return None
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(config.host, config.host)
        scheme = "https" if config.security is not None and config.security.tls_cert else "http"
        return f"{scheme}://{_join(host, port)}{path}"

    @property
    def secrets_dir(self) -> Path:
        """Where generated tokens are written (``stack_secrets``)."""
        return self.log_dir / "secrets"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    @property
    def client_tls(self):
        """ClientTls for talking to the children (None when they serve plaintext)."""
        security = self.config.security
        return security.client_tls() if security is not None and security.tls_cert else None

    def pid(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int | None:
        """Signals one child (default SIGKILL, a crash) and waits for it to exit."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def restart(self, name: str, *, wait_ready: bool = True) -> None:
        """Starts a child again with the same command line (a new process: an
        executor comes back with a new incarnation), after it has exited;
        waits for its health to report SERVING unless told not to. From
        inside an event loop use ``arestart``."""
        import asyncio

        if wait_ready:
            asyncio.run(self.arestart(name))
        else:
            self._respawn(name)

    async def arestart(self, name: str, timeout_s: float | None = None) -> None:
        """``restart`` for async callers: spawns from the calling thread (the
        parent-death signal follows that thread) and awaits SERVING. Only
        this child's exit fails the wait (others may be down on purpose).

        Raises:
            StackError: the child exited or was not SERVING in time.
        """
        import asyncio

        from kvpager.channel import wait_for_serving

        child = self._respawn(name)
        proc = self.procs[name]
        deadline = time.monotonic() + (timeout_s or self.config.ready_timeout_s)
        host, port = child.address.rsplit(":", 1)
        while not _accepts(host, int(port)):
            if proc.poll() is not None:
                raise self._error(child, f"exited with code {proc.returncode} on restart")
            if time.monotonic() > deadline:
                raise self._error(child, f"not listening on {child.address} after restart")
            await asyncio.sleep(0.05)
        task = asyncio.ensure_future(wait_for_serving(child.address, max(deadline - time.monotonic(), 0.1),
                                                      tls=self.client_tls))
        while not task.done():
            if proc.poll() is not None:
                task.cancel()
                raise self._error(child, f"exited with code {proc.returncode} on restart")
            await asyncio.wait({task}, timeout=0.1)
        try:
            task.result()
        except TimeoutError as exc:
            raise self._error(child, str(exc)) from None

    def _respawn(self, name: str) -> ChildSpec:
        child = next(c for c in self.children if c.name == name)
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running; kill it first")
        self._spawn(child)
        return child

    def start(self) -> Stack:
        import asyncio

        if self.procs:
            raise RuntimeError("already started")
        if self.config.model is None:
            from kvpager_tools.demo_model import ensure_demo_model

            self.config = dataclasses.replace(self.config, model=str(ensure_demo_model()))
        self.config = self.config.with_ports_filled()
        self.log_dir = Path(self.config.log_dir or tempfile.mkdtemp(prefix="kvpager-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.config.generate_admin_token:
            from kvpager_tools.stack_secrets import with_generated_tokens

            self.config = dataclasses.replace(self.config, security=with_generated_tokens(
                self.config.security, self.config.host, self.secrets_dir))
        self.children = build_children(self.config)
        self._check_ports_free()
        tiers = [[c for c in self.children if c.role == role] for role in ROLES]
        try:
            for tier in tiers:
                for child in tier:
                    self._spawn(child)
                asyncio.run(self._wait_ready(tier))
                self._check_all_alive()  # e.g. a child that lost its port to someone else
            asyncio.run(self._wait_executors_routed())
        except BaseException:
            self.stop()
            raise
        return self

    def _check_ports_free(self) -> None:
        # Otherwise the health wait could find another process's server there.
        config = self.config
        flags = {config.memory_port: "--memory-port", config.gateway_port: "--gateway-port",
                 config.http_port: "--http-port", config.blockmap_port: "--blockmap-port"}
        host = self.children[0].address.rsplit(":", 1)[0]
        for port in config.ports():
            if port is not None and _accepts(host, port):
                flag = flags.get(port) or ("--executor-base-port" if config.executor_base_port <= port <
                                           config.executor_base_port + config.num_executors else "--metrics-base-port")
                owner = next((c.name for c in self.children if c.address.endswith(f":{port}")), "kvpager up")
                raise StackError(owner, f"{flag}: port {port} is already in use (0 picks a free one)", None, "",
                                 usage=True)

    def _spawn(self, child: ChildSpec) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
        if self.config.security is not None:  # tokens by environment: argv is visible to everyone
            env.update(self.config.security.child_env())
        argv = child.argv
        if self.die_with_parent:
            argv = _with_parent_death_signal(argv)
            env["KVPAGER_PARENT_PID"] = str(os.getpid())
        with open(self.log_path(child.name), "ab") as log:
            self.procs[child.name] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

    async def _wait_ready(self, tier: list[ChildSpec]) -> None:
        import asyncio

        from kvpager.channel import wait_for_serving

        deadline = time.monotonic() + self.config.ready_timeout_s

        async def one(child: ChildSpec) -> None:
            host, port = child.address.rsplit(":", 1)
            # Wait for the port first: a channel that failed to connect backs
            # off for seconds, which would delay noticing SERVING.
            while not _accepts(host, int(port)):
                self._check_all_alive()
                if time.monotonic() > deadline:
                    raise self._error(child, f"not listening on {child.address} after "
                                             f"{self.config.ready_timeout_s:g}s")
                await asyncio.sleep(0.1)
            task = asyncio.ensure_future(wait_for_serving(child.address, max(deadline - time.monotonic(), 0.1),
                                                          tls=self.client_tls))
            try:
                while not task.done():
                    if any(p.poll() is not None for p in self.procs.values()):
                        task.cancel()
                        self._check_all_alive()
                    await asyncio.wait({task}, timeout=0.1)
                task.result()
            except TimeoutError as exc:
                raise self._error(child, str(exc)) from None

        await asyncio.gather(*(one(c) for c in tier))

    async def _wait_executors_routed(self) -> None:
        """Until the gateway routes to every executor (it learns them from the
        memory service's registry; SERVING needs only one)."""
        gateway = next(c for c in self.children if c.role == "gateway")
        security = self.config.security
        try:
            await wait_routed(gateway.address, self.config.num_executors, tls=self.client_tls,
                              token=security.auth_token if security else None,
                              timeout_s=self.config.ready_timeout_s, check=self._check_all_alive)
        except TimeoutError as exc:
            raise self._error(gateway, str(exc)) from None

    def _check_all_alive(self) -> None:
        # Any child, not only this tier's: executors never become SERVING
        # once the memory service they register with is gone.
        dead = self.poll()
        if dead is not None:
            child = next(c for c in self.children if c.name == dead[0])
            raise self._error(child, f"exited with code {dead[1]} during start-up")

    def _error(self, child: ChildSpec, reason: str) -> StackError:
        path = self.log_path(child.name)
        return StackError(child.name, reason, path, _tail(path))

    def poll(self) -> tuple[str, int] | None:
        """(name, exit code) of the first child that has exited, if any."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def stop(self) -> dict[str, int]:
        """SIGTERM per tier in reverse start order (gateway, executors, memory),
        each tier waited up to ``grace_s``, then SIGKILL. Returns exit codes.

        The gateway's SIGTERM is the drain: it stops admitting at once, lets
        requests in flight finish for ``drain_timeout_s`` (its ``--grace-s``),
        then cancels the rest (their blocks are freed while the executors and
        the memory service still run), so its tier waits that much longer."""
        for role in reversed(ROLES):
            live = [self.procs[c.name] for c in self.children
                    if c.role == role and c.name in self.procs and self.procs[c.name].poll() is None]
            for proc in live:
                proc.send_signal(signal.SIGTERM)
            wait_s = self.config.grace_s + (self.config.drain_timeout_s if role == "gateway" else 0.0)
            deadline = time.monotonic() + wait_s
            for proc in live:
                try:
                    proc.wait(max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        # In stop order (gateway, executors, memory).
        return {c.name: self.procs[c.name].returncode for role in reversed(ROLES) for c in self.children
                if c.role == role and c.name in self.procs}

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *_exc) -> None:
        self.stop()


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.5):
            return True
    except OSError:
        return False
