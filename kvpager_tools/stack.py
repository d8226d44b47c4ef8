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

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvpager_tools.ports import free_port, free_port_range

if TYPE_CHECKING:
    from kvpager.security import SecurityConfig

ROLES = ("memory", "executor", "gateway")
ENTRY_POINTS = {"memory": "memory_service", "executor": "executor_service", "gateway": "gateway"}  # python -m
DEMO_NUM_BLOCKS = 256  # `kvpager up --demo` pool per executor unless sized


@dataclasses.dataclass(slots=True)
class StackConfig:
    """What ``kvpager up`` starts. Ports are fixed unless ``on_free_ports``.

    Metrics ports, when ``metrics_base_port`` is set: memory = base,
    gateway = base + 1, executor i = base + 2 + i.
    """

    model: str | None = None              # checkpoint dir; None = the demo model (built on first use)
    num_executors: int = 1
    host: str = "127.0.0.1"
    memory_port: int = 50051
    gateway_port: int = 50050
    http_port: int | None = 8000          # the gateway's OpenAI-compatible HTTP API; None = off
    blockmap_port: int | None = 8001      # the memory service's live block map (HTTP); None = off
    executor_base_port: int = 50060       # executor i listens on base + i
    metrics_base_port: int | None = None  # None = no Prometheus endpoints
    block_size: int = 16                  # tokens per block
    num_blocks: int | None = None         # per executor; None = the executor's default sizing
    kv_cache_gib: float | None = None     # per executor (exclusive with num_blocks)
    swap_blocks: int | None = None
    redis_url: str | None = None          # mirror on (memory service and gateway); None = in-memory only
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: str = "auto"
    model_impl: str = "auto"              # executor: kvpager's own Llama forward | transformers
    log_dir: str | None = None            # None = a fresh temp dir
    log_level: str = "INFO"
    ready_timeout_s: float = 180.0        # per tier (memory, executors, gateway)
    grace_s: float = 10.0                 # per tier on stop, before SIGKILL
    python: str = sys.executable
    extra_args: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # role -> extra flags
    security: SecurityConfig | None = None  # TLS flags go to every child, tokens through its environment

    def __post_init__(self) -> None:
        if self.num_executors < 1:
            raise ValueError("num_executors must be >= 1")
        if self.num_blocks is not None and self.kv_cache_gib is not None:
            raise ValueError("num_blocks and kv_cache_gib are exclusive")
        unknown = set(self.extra_args) - set(ROLES)
        if unknown:
            raise ValueError(f"extra_args roles must be among {ROLES}, got {sorted(unknown)}")

    def on_free_ports(self) -> StackConfig:
        """A copy on ports free right now (executors on consecutive ones)."""
        return self._fill_ports(lambda port: True)

    def with_ports_filled(self) -> StackConfig:
        """A copy where every port given as 0 is replaced by one free right now."""
        return self._fill_ports(lambda port: port == 0)

    def ports(self) -> list[int]:
        """Every port the stack listens on (None-valued ones left out)."""
        out = [self.memory_port, self.gateway_port, self.http_port, self.blockmap_port,
               *range(self.executor_base_port, self.executor_base_port + self.num_executors)]
        if self.metrics_base_port is not None:
            out += range(self.metrics_base_port, self.metrics_base_port + 2 + self.num_executors)
        return [p for p in out if p is not None]

    def _fill_ports(self, replace) -> StackConfig:
        # Ports found free one at a time may coincide (each probe closes before the next): retry until distinct.
        for _ in range(20):
            filled = self._fill_once(replace)
            ports = [p for p in filled.ports() if p]
            if len(ports) == len(set(ports)):
                return filled
        return filled

    def _fill_once(self, replace) -> StackConfig:
        num_metrics = 2 + self.num_executors
        mbase = self.metrics_base_port
        return dataclasses.replace(
            self,
            memory_port=free_port(self.host) if replace(self.memory_port) else self.memory_port,
            gateway_port=free_port(self.host) if replace(self.gateway_port) else self.gateway_port,
            http_port=(free_port(self.host) if self.http_port is not None and replace(self.http_port)
                       else self.http_port),
            blockmap_port=(free_port(self.host) if self.blockmap_port is not None and replace(self.blockmap_port)
                           else self.blockmap_port),
            executor_base_port=(free_port_range(self.num_executors, self.host)
                                if replace(self.executor_base_port) else self.executor_base_port),
            metrics_base_port=(free_port_range(num_metrics, self.host)
                               if mbase is not None and replace(mbase) else mbase),
        )


@dataclasses.dataclass(slots=True)
class ChildSpec:
    """One child process: what to run and where it answers health."""

    name: str                      # "memory", "executor-0", "gateway"
    role: str                      # one of ROLES
    argv: list[str]
    address: str                   # host:port of its gRPC server
    metrics_port: int | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # added to the inherited environment


@dataclasses.dataclass(frozen=True, slots=True)
class StackAddresses:
    memory: str
    gateway: str
    executors: tuple[str, ...]
    metrics: dict[str, int]        # child name -> Prometheus port (only those with one)
    http: str | None = None        # the gateway's HTTP API base URL ("http://host:port"; OpenAI's is + "/v1")
    blockmap: str | None = None    # the block map page ("http://host:port/")


class StackError(RuntimeError):
    """A child died or never became SERVING during start-up."""

    def __init__(self, child: str, reason: str, log_path: Path | None, log_tail: str) -> None:
        super().__init__(f"{child}: {reason}")
        self.child, self.reason, self.log_path, self.log_tail = child, reason, log_path, log_tail


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


@dataclasses.dataclass
class StackOptions:
    """A local stack as benchmarks and drills describe it (``kvpager drill
    NAME --help`` lists these as flags); ``config()`` is its StackConfig.
    Zero or empty means the service's own default."""

    model: str = dataclasses.field(default="", metadata={"help": "checkpoint dir (default: the demo model)"})
    executors: int = dataclasses.field(default=1, metadata={"help": "executors (a drill takes at least what it needs)"})
    num_blocks: int = dataclasses.field(default=0, metadata={"help": "KV blocks per executor (0: its own sizing)"})
    block_size: int = 16
    dtype: str = dataclasses.field(default="auto", metadata={"help": "executor dtype: auto | float32 | bfloat16 | float16"})
    swap_blocks: int = dataclasses.field(default=-1, metadata={"help": "CPU swap blocks per executor (-1: its own)"})
    model_impl: str = dataclasses.field(default="auto", metadata={"help": "executor forward: auto | kvpager | transformers"})
    max_model_len: int = dataclasses.field(default=0, metadata={"help": "context limit of the executors (0: the model's)"})
    max_batch_tokens: int = dataclasses.field(default=0, metadata={"help": "gateway: tokens per executor and step"})
    max_running: int = dataclasses.field(default=0, metadata={"help": "gateway: sequences per executor and step"})
    routing: str = dataclasses.field(default="", metadata={"help": "gateway: prefix | round-robin"})
    metrics: bool = dataclasses.field(default=False, metadata={"help": "Prometheus endpoints on"})
    gateway_args: str = dataclasses.field(default="", metadata={"help": "extra gateway flags, one string"})
    executor_args: str = dataclasses.field(default="", metadata={"help": "extra executor flags, one string"})
    log_dir: str = dataclasses.field(default="", metadata={"help": "child logs (default: a temp dir)"})
    log_level: str = dataclasses.field(default="WARNING", metadata={"help": "children's log level"})
    secure: bool = dataclasses.field(default=False, metadata={
        "help": "mutual TLS (certs from scripts/make-dev-ca.sh) + gateway and admin tokens on every service"})
    cert_dir: str = dataclasses.field(default="", metadata={
        "help": "with --secure: the certificates of scripts/make-dev-ca.sh DIR (default: fresh ones)"})
    seed: int = 0

    def config(self, *, security=None, extra: dict[str, list[str]] | None = None, **overrides) -> StackConfig:
        """The StackConfig on free ports; ``extra``: more flags per role."""
        import shlex

        args: dict[str, list[str]] = {"memory": [], "executor": shlex.split(self.executor_args),
                                      "gateway": shlex.split(self.gateway_args)}
        if self.max_model_len:
            args["executor"] += ["--max-model-len", str(self.max_model_len)]
        for flag, value in (("--max-batch-tokens", self.max_batch_tokens), ("--max-running", self.max_running),
                            ("--routing", self.routing)):
            if value:
                args["gateway"] += [flag, str(value)]
        for role, flags in (extra or {}).items():
            args[role] += flags
        fields = dict(model=self.model or None, num_executors=self.executors, num_blocks=self.num_blocks or None,
                      block_size=self.block_size, dtype=self.dtype, model_impl=self.model_impl,
                      swap_blocks=None if self.swap_blocks < 0 else self.swap_blocks,
                      log_dir=self.log_dir or None, log_level=self.log_level,
                      metrics_base_port=0 if self.metrics else None, security=security,
                      extra_args={role: flags for role, flags in args.items() if flags})
        fields.update(overrides)
        return StackConfig(**fields).on_free_ports()


def build_children(config: StackConfig) -> list[ChildSpec]:
    """The child command lines, in start order. ``config.model`` must be set."""
    if config.model is None:
        raise ValueError("resolve the model first (Stack does: the demo model)")
    host, py = config.host, config.python
    # Where to connect: a wildcard listen address is reached over loopback.
    near = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    memory_address = _join(near, config.memory_port)
    mbase = config.metrics_base_port

    def metrics(offset: int) -> tuple[list[str], int | None]:
        return ([], None) if mbase is None else (["--metrics-port", str(mbase + offset)], mbase + offset)

    def kvpager(role: str, *args: str) -> list[str]:
        security = config.security.child_args(role) if config.security is not None else []
        return [py, "-m", ENTRY_POINTS[role], *args, "--log-level", config.log_level, *security,
                *config.extra_args.get(role, [])]

    redis = ["--redis-url", config.redis_url] if config.redis_url else []
    children = []
    flags, port = metrics(0)
    blockmap = ["--http-port", str(config.blockmap_port)] if config.blockmap_port is not None else []
    children.append(ChildSpec("memory", "memory", kvpager(
        "memory", "--host", host, "--port", str(config.memory_port), *flags, *blockmap, *redis),
        memory_address, port))
    executor_env = cpu_executor_env(config)
    for i in range(config.num_executors):
        flags, port = metrics(2 + i)
        exec_port = config.executor_base_port + i
        advertise = ["--advertise-address", _join(near, exec_port)] if near != host else []
        pool = (["--num-blocks", str(config.num_blocks)] if config.num_blocks is not None else
                ["--kv-cache-gib", str(config.kv_cache_gib)] if config.kv_cache_gib is not None else [])
        swap = ["--swap-blocks", str(config.swap_blocks)] if config.swap_blocks is not None else []
        children.append(ChildSpec(f"executor-{i}", "executor", kvpager(
            "executor", "--model", config.model, "--executor-id", f"executor-{i}",
            "--host", host, "--port", str(exec_port), *advertise, *flags, "--memory-address", memory_address,
            "--block-size", str(config.block_size), *pool, *swap, "--dtype", config.dtype,
            "--device", config.device, "--attention-backend", config.attention_backend,
            "--model-impl", config.model_impl,
        ), _join(near, exec_port), port, dict(executor_env)))
    flags, port = metrics(1)
    http = ["--http-port", str(config.http_port)] if config.http_port is not None else ["--no-http"]
    children.append(ChildSpec("gateway", "gateway", kvpager(
        "gateway", "--host", host, "--port", str(config.gateway_port), *flags,
        "--memory-address", memory_address, "--model", config.model, *http, *redis,
    ), _join(near, config.gateway_port), port))
    return children


def cpu_executor_env(config: StackConfig, cores: int | None = None) -> dict[str, str]:
    """Several CPU executors on one host share its cores: each gets its slice
    as OMP_NUM_THREADS (unless the user set one). Left alone, every executor
    runs an OpenMP team as wide as the machine and their spinning threads
    displace each other (4 executors on 2 cores: 8 spinning threads)."""
    if config.device != "cpu" or config.num_executors <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return {}
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // config.num_executors))}


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        for child in self.children:
            http = {"gateway": self.config.http_port, "memory": self.config.blockmap_port}.get(child.role)
            for port in (int(child.address.rsplit(":", 1)[1]), child.metrics_port, http):
                if port is not None and _accepts(child.address.rsplit(":", 1)[0], port):
                    raise StackError(child.name, f"port {port} is already in use (0 picks a free one)", None, "")

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
        each tier waited up to ``grace_s``, then SIGKILL. Returns exit codes."""
        for role in reversed(ROLES):
            live = [self.procs[c.name] for c in self.children
                    if c.role == role and c.name in self.procs and self.procs[c.name].poll() is None]
            for proc in live:
                proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.config.grace_s
            for proc in live:
                try:
                    proc.wait(max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        return {name: proc.returncode for name, proc in self.procs.items()}

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


# --- the same services in this process (tests) -----------------------------------------------


@dataclasses.dataclass
class InProcessStack:
    """The three services in this process, on one event loop and loopback gRPC:
    for tests that look inside them (the engine, the manager). ``Stack`` runs
    them as child processes instead."""

    memory: object      # memory_service.service.MemoryServer
    executors: list     # executor_service.service.ExecutorServer each
    gateway: object     # gateway.service.GatewayServer
    channels: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        from kvpager.channel import make_channel
        from kvpager.v1 import gateway_pb2_grpc, memory_pb2_grpc

        gch = make_channel(self.gateway.address)
        mch = make_channel(self.memory.address)
        self.channels = [gch, mch]
        self.gw = gateway_pb2_grpc.GatewayStub(gch)
        self.mem = memory_pb2_grpc.MemoryServiceStub(mch)

    async def accounting(self):
        from kvpager.v1 import memory_pb2

        return (await self.mem.GetAccounting(memory_pb2.AccountingRequest())).total

    async def wait_idle(self, timeout_s: float = 10.0):
        """Until every block is free (finished/aborted sequences are released
        in the step after they end)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            t = await self.accounting()
            if t.used_blocks == 0 and t.num_sequences == 0 and t.num_swapped_sequences == 0:
                return t
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"blocks not released: {t}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for ch in self.channels:
            await ch.close()
        await self.gateway.stop(0)
        for ex in self.executors:
            await ex.stop(0)
        await self.memory.stop(0)


async def start_in_process(model: str, *, executors: int = 1, num_blocks: int = 96, block_size: int = 4,
                           swap_blocks: int = 64, swap_min_tokens: int = 256, preemption_mode: str = "cost",
                           redis_url: str | None = None, http: dict | None = None, gateway_kw: dict | None = None,
                           metrics: bool = False, memory_kw: dict | None = None,
                           executor_kw: dict | None = None, **engine_kw) -> InProcessStack:
    """Memory service, ``executors`` executors and a gateway (EngineConfig ``engine_kw``) in this
    process; returns once the gateway routes to every executor. ``http``: serve the HTTP API
    on a free port (HttpConfig fields; ``gateway.http_url``), else none; ``gateway_kw``,
    ``memory_kw``, ``executor_kw``: more GatewayConfig / MemoryConfig / ExecutorConfig fields; ``metrics``: every service serves
    /metrics on a free port (``<server>.runtime.metrics_port``)."""
    import asyncio

    from executor_service.config import ExecutorConfig
    from executor_service.service import start_executor_server
    from gateway.engine import EngineConfig
    from gateway.http.server import HttpConfig
    from gateway.service import GatewayConfig, GatewayServer
    from memory_service.service import MemoryConfig, MemoryServer

    mport = 0 if metrics else None
    memory = await MemoryServer(MemoryConfig(port=0, swap_min_tokens=swap_min_tokens,
                                             preemption_mode=preemption_mode, redis_url=redis_url,
                                             metrics_port=mport, **(memory_kw or {}))).start()
    exs = []
    for i in range(executors):
        exs.append(await start_executor_server(ExecutorConfig(
            model=model, executor_id=f"executor-{i}", memory_address=memory.address, num_blocks=num_blocks,
            block_size=block_size, swap_blocks=swap_blocks, metrics_port=mport,
            **{"kv_layout": "auto", **(executor_kw or {})})))  # auto: as `kvpager up` serves (the CLI's default)
    engine_kw.setdefault("executor_refresh_s", 0.2)
    http_config = HttpConfig(**{"port": 0, **http}) if http is not None else None
    gateway = await GatewayServer(GatewayConfig(model=model, memory_address=memory.address, port=0,
                                                redis_url=redis_url, engine=EngineConfig(**engine_kw),
                                                http=http_config, metrics_port=mport,
                                                **(gateway_kw or {}))).start()
    await gateway.wait_ready(30)
    while len(gateway.engine.executors) < executors:
        await asyncio.sleep(0.05)
    return InProcessStack(memory, exs, gateway)


# --- `kvpager up` -----------------------------------------------------------------

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start memory service, executors and gateway locally (Ctrl-C stops)")
    p.add_argument("--model", default=None, help="HF checkpoint dir (default: the demo model, built once)")
    p.add_argument("--executors", type=int, default=1, help="number of executors")
    p.add_argument("--host", default="127.0.0.1", help="listen address of every service")
    p.add_argument("--memory-port", type=int, default=50051, help="0 = any free port (as for every port flag)")
    p.add_argument("--gateway-port", type=int, default=50050)
    p.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI-compatible HTTP API")
    p.add_argument("--no-http", action="store_true", help="the gateway serves gRPC only")
    p.add_argument("--blockmap-port", type=int, default=8001, help="the memory service's live block map (HTTP)")
    p.add_argument("--no-blockmap", action="store_true", help="no block map")
    p.add_argument("--executor-base-port", type=int, default=50060, help="executor i listens on base + i")
    p.add_argument("--metrics-base-port", type=int, default=None,
                   help="Prometheus: memory = base, gateway = base+1, executor i = base+2+i (default: off)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks per executor")
    size.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size per executor")
    p.add_argument("--swap-blocks", type=int, default=None, help="CPU swap pool blocks per executor")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--redis-url", default=None, help="turn the Redis mirror on (memory service and gateway)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--device", default="cpu", help="executor device: cpu (default) | cuda | cuda:N | auto")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "cpu", "triton"))
    p.add_argument("--model-impl", default="auto", choices=("auto", "kvpager", "transformers"),
                   help="executor forward: kvpager's own for the Llama family (auto) or transformers' code")
    p.add_argument("--log-dir", default=None, help="child logs (default: a fresh temp dir)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    p.add_argument("--grace-s", type=float, default=10.0, help="per tier on stop, then SIGKILL")
    p.add_argument("--demo", action="store_true",
                   help="run a short streaming demo against the stack, show block accounting, then stop "
                        f"(pool of {DEMO_NUM_BLOCKS} blocks unless sized)")
    from gateway.cli import add_scheduling_arguments
    from kvpager.security import add_security_arguments

    add_scheduling_arguments(p)  # passed on to the gateway, every one
    # Passed to every child: TLS files as flags, tokens through the environment.
    add_security_arguments(p, server=True, client=True, auth_token=True, admin_token=True, open_read_only=True)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> StackConfig:
    from gateway.cli import scheduling_argv
    from kvpager.security import security_from_args

    security = security_from_args(args)
    num_blocks = args.num_blocks
    if args.demo and num_blocks is None and args.kv_cache_gib is None:
        num_blocks = DEMO_NUM_BLOCKS  # a small pool keeps the accounting readable
    return StackConfig(
        model=args.model, num_executors=args.executors, host=args.host, memory_port=args.memory_port,
        gateway_port=args.gateway_port, http_port=None if args.no_http else args.http_port,
        blockmap_port=None if args.no_blockmap else args.blockmap_port,
        executor_base_port=args.executor_base_port,
        metrics_base_port=args.metrics_base_port, block_size=args.block_size, num_blocks=num_blocks,
        kv_cache_gib=args.kv_cache_gib, swap_blocks=args.swap_blocks, redis_url=args.redis_url,
        dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        model_impl=args.model_impl, log_dir=args.log_dir,
        log_level=args.log_level, ready_timeout_s=args.ready_timeout_s, grace_s=args.grace_s,
        extra_args={"gateway": scheduling_argv(args)},
        security=security if security.enabled or security.open_read_only else None)


def _print_ready(stack: Stack, console) -> None:
    a = stack.addresses
    console.print(f"[bold green]kvpager stack ready[/] (logs in {stack.log_dir})")
    for child in stack.children:
        metrics = f"  metrics :{child.metrics_port}" if child.metrics_port is not None else ""
        console.print(f"  {child.name:<12} {child.address}{metrics}")
    console.print("try:")
    security = stack.config.security
    tls = ""
    if security is not None and security.tls_cert:
        tls = f" --tls-ca {security.tls_ca}" if security.tls_ca else ""
        if security.tls_require_client_auth:
            tls += " --tls-client-cert CERT --tls-client-key KEY"
    gen_token = " (with $KVPAGER_AUTH_TOKEN set)" if security is not None and security.auth_token else ""
    blk_token = " (with $KVPAGER_ADMIN_TOKEN set)" if security is not None and security.admin_token else ""
    console.print(f"  kvpager generate \"Once upon a time\" --address {a.gateway} --max-tokens 32{tls}{gen_token}")
    console.print(f"  kvpager blocks --address {a.memory}{tls}{blk_token}")
    if a.blockmap is not None:
        key = " (it asks for the admin token)" if security is not None and security.admin_token and \
            not security.open_read_only else ""
        console.print(f"  the live block map: {a.blockmap}{key}")
    if a.http is not None:
        key = " (with the auth token as the API key)" if security is not None and security.auth_token else ""
        console.print(f"  OpenAI-compatible API: {a.http}/v1{key}")
        console.print(f"  curl {a.http}/v1/completions -H 'Content-Type: application/json' "
                      f"-d '{{\"prompt\": \"Once upon a time\", \"max_tokens\": 16}}'")


async def _demo(stack: Stack, console) -> None:
    import asyncio

    from kvpager_tools.generate import run_demo
    from kvpager.channel import make_channel
    from kvpager.v1 import memory_pb2, memory_pb2_grpc
    from kvpager_tools.blocks import render_table, snapshot_dict

    a = stack.addresses
    security = stack.config.security
    admin = security.admin_token if security is not None else None
    auth = security.auth_token if security is not None else None
    async with make_channel(a.memory, tls=stack.client_tls, token=admin) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        peak: dict = {}

        async def watch() -> None:  # keep the snapshot with the most blocks in use
            async for snap in stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=100)):
                data = snapshot_dict(snap)
                if data["used_blocks"] >= peak.get("used_blocks", -1):
                    peak.clear()
                    peak.update(data)

        watcher = asyncio.ensure_future(watch())
        try:
            await run_demo(a.gateway, console, tls=stack.client_tls, token=auth)
        finally:
            watcher.cancel()
        final = snapshot_dict(await stub.GetAccounting(memory_pb2.AccountingRequest(), timeout=10))
    if peak:
        console.print("\n[bold]KV blocks at peak[/] (most blocks in use):")
        console.print(render_table(peak))
    console.print("\n[bold]KV blocks after every request finished[/] (cached blocks stay for prefix hits):")
    console.print(render_table(final))


def _run_demo(stack: Stack, console) -> int:
    import asyncio

    import grpc

    try:
        asyncio.run(_demo(stack, console))
    except grpc.RpcError as exc:
        console.print(f"[red]demo failed: {exc.code().name}: {exc.details()}[/]")
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        config = config_from_args(args)
    except ValueError as exc:
        console.print(f"kvpager up: {exc}", style="red")
        return 2
    stack = Stack(config)
    # SIGTERM behaves like Ctrl-C: unwind, then stop the children in order.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    code = 0
    try:
        console.print(f"starting {config.num_executors} executor(s)"
                      f" on {config.model or 'the demo model (built on first use)'}, device {config.device} …")
        stack.start()
        _print_ready(stack, console)
        if args.demo:
            return _run_demo(stack, console)
        console.print("Ctrl-C stops the stack.")
        while (dead := stack.poll()) is None:
            time.sleep(0.2)
        name, exit_code = dead
        console.print(f"[red]{name} exited with code {exit_code}[/]; its log ({stack.log_path(name)}) ends:")
        console.print(_tail(stack.log_path(name)), markup=False, highlight=False)
        code = 1
    except StackError as exc:
        console.print(f"[red]kvpager up: {exc}[/]" + (f"; its log ({exc.log_path}) ends:" if exc.log_tail else ""))
        if exc.log_tail:
            console.print(exc.log_tail, markup=False, highlight=False)
        code = 1
    except KeyboardInterrupt:
        code = 0
    finally:
        # Ignore further Ctrl-C while stopping: the grace periods bound it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        console.print("stopping …")
        codes = stack.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)
        if codes:
            console.print("stopped: " + ", ".join(f"{n} ({c})" for n, c in codes.items()))
    return code
