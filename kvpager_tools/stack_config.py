"""What a local stack is: ``StackConfig`` (ports, pool, model, security),
the child command lines it implies (``build_children``) and ``StackOptions``,
the same as benchmark and drill flags. No processes here (``kvpager_tools.stack``
starts them)."""

from __future__ import annotations

import dataclasses
import os
import sys
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
    gateway = base + 1, executor i = base + 2 + i, and `kvpager up`'s
    supervisor base + 2 + num_executors.
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
    drain_timeout_s: float = 30.0         # on stop, the gateway finishes in-flight requests this long first
    generate_admin_token: bool = False    # no admin token given: make one (kvpager_tools.stack_secrets)
    python: str = sys.executable
    extra_args: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # role -> extra flags
    security: SecurityConfig | None = None  # TLS flags go to every child, tokens through its environment

    def __post_init__(self) -> None:
        if self.num_executors < 1:
            raise ValueError("num_executors must be >= 1")
        if self.num_blocks is not None and self.kv_cache_gib is not None:
            raise ValueError("num_blocks and kv_cache_gib are exclusive")
        if self.drain_timeout_s < 0 or self.grace_s < 0:
            raise ValueError("--drain-timeout-s and --grace-s must be >= 0")
        unknown = set(self.extra_args) - set(ROLES)
        if unknown:
            raise ValueError(f"extra_args roles must be among {ROLES}, got {sorted(unknown)}")

    @property
    def supervisor_metrics_port(self) -> int | None:
        """Where `kvpager up` serves its supervisor's metrics (None: metrics off)."""
        return None if self.metrics_base_port is None else self.metrics_base_port + 2 + self.num_executors

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
            out += range(self.metrics_base_port, self.metrics_base_port + 3 + self.num_executors)
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
        num_metrics = 3 + self.num_executors
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
    num_scheduler_steps: int = dataclasses.field(default=0, metadata={
        "help": "gateway: decode burst length (0: the gateway's default)"})
    max_burst_ms: float = dataclasses.field(default=0.0, metadata={
        "help": "gateway: longest decode burst in measured forward time, ms (0: the gateway's default)"})
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
                            ("--num-scheduler-steps", self.num_scheduler_steps), ("--routing", self.routing),
                            ("--max-burst-ms", self.max_burst_ms)):
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
    slices = cpu_executor_cores(config)
    for i in range(config.num_executors):
        flags, port = metrics(2 + i)
        exec_port = config.executor_base_port + i
        advertise = ["--advertise-address", _join(near, exec_port)] if near != host else []
        pool = (["--num-blocks", str(config.num_blocks)] if config.num_blocks is not None else
                ["--kv-cache-gib", str(config.kv_cache_gib)] if config.kv_cache_gib is not None else [])
        swap = ["--swap-blocks", str(config.swap_blocks)] if config.swap_blocks is not None else []
        own = ["--cpu-cores", slices[i]] if slices else []
        children.append(ChildSpec(f"executor-{i}", "executor", kvpager(
            "executor", "--model", config.model, "--executor-id", f"executor-{i}",
            "--host", host, "--port", str(exec_port), *advertise, *flags, "--memory-address", memory_address,
            "--block-size", str(config.block_size), *pool, *swap, "--dtype", config.dtype,
            "--device", config.device, "--attention-backend", config.attention_backend,
            "--model-impl", config.model_impl, *own,
        ), _join(near, exec_port), port, dict(executor_env)))
    flags, port = metrics(1)
    http = ["--http-port", str(config.http_port)] if config.http_port is not None else ["--no-http"]
    children.append(ChildSpec("gateway", "gateway", kvpager(
        "gateway", "--host", host, "--port", str(config.gateway_port), *flags,
        "--memory-address", memory_address, "--model", config.model, *http, *redis,
        # Its own graceful stop is the stack's drain: in-flight requests finish, new ones are refused.
        "--grace-s", f"{config.drain_timeout_s:g}",
    ), _join(near, config.gateway_port), port))
    return children


def _splits_cpus(config: StackConfig) -> bool:
    """Several CPU executors whose thread counts the stack chooses (not the user's OMP_NUM_THREADS)."""
    return config.device == "cpu" and config.num_executors > 1 and not os.environ.get("OMP_NUM_THREADS")


def _host_cpus() -> tuple[int, ...] | None:
    """The CPUs this process may run on, in order (None off Linux: no affinity there)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:
        return None


def cpu_executor_cores(config: StackConfig, allowed: tuple[int, ...] | None = None) -> list[str] | None:
    """Several CPU executors on one host, with as many cores or more: executor
    i's own slice of them (``--cpu-cores``), ``len(allowed) // N`` each; the
    remainder stays free for the control plane. None (all share every core)
    for one executor, a GPU, fewer cores than executors, or an
    OMP_NUM_THREADS of the user's (their thread count would not match a
    slice). Each executor's threads then stay on its slice: two executors'
    teams never meet on one core (a lone request after idle found its two
    threads on one core even within one executor: executor_service.cpu)."""
    if not _splits_cpus(config) or (allowed := allowed or _host_cpus()) is None:
        return None
    each = len(allowed) // config.num_executors
    if each < 1:
        return None
    return [",".join(str(c) for c in allowed[i * each:(i + 1) * each]) for i in range(config.num_executors)]


def cpu_executor_env(config: StackConfig, cores: int | None = None) -> dict[str, str]:
    """Several CPU executors on one host share its cores: each gets its slice
    as OMP_NUM_THREADS (unless the user set one). Left alone, every executor
    runs an OpenMP team as wide as the machine and their spinning threads
    displace each other (4 executors on 2 cores: 8 spinning threads)."""
    if not _splits_cpus(config):
        return {}
    if cores is None:
        host = _host_cpus()
        cores = len(host) if host is not None else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // config.num_executors))}


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
