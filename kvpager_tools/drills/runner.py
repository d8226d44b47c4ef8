"""Starting a stack for drills, running one drill on it, and its CLI flags.

    with drill_stack(Needs(executors=2)) as env:       # a Stack (+ Redis) on free ports
        result = run_drill(env, "cancel", streams=50)    # DrillResult, after the common checks
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import secrets
import subprocess
import tempfile
import time
from pathlib import Path

from kvpager_tools.drills.common import DrillEnv, DrillResult

# drill name -> module under kvpager_tools.drills
DRILLS = {
    "bad-input": "bad_input",
    "fuzz": "fuzz",
    "cancel": "cancel",
    "executor-kill": "executor_kill",
    "memory-restart": "memory_restart",
    "redis-kill": "redis_kill",
    "load": "load",
    "soak": "soak",
}


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a drill needs from its stack."""

    executors: int = 1
    redis: bool = False  # the memory service mirrors to a Redis the drill may kill

    def union(self, other: Needs) -> Needs:
        return Needs(max(self.executors, other.executors), self.redis or other.redis)


@dataclasses.dataclass
class StackOptions:
    """The stack a drill runs on (``kvpager drill NAME --help`` lists them)."""

    executors: int = dataclasses.field(default=0, metadata={"help": "0 = what the drill needs"})
    num_blocks: int = dataclasses.field(default=512, metadata={"help": "KV blocks per executor"})
    block_size: int = 16
    swap_blocks: int = 128
    max_model_len: int = dataclasses.field(default=512, metadata={"help": "context limit of the executors"})
    model: str = dataclasses.field(default="", metadata={"help": "checkpoint dir (default: the demo model)"})
    log_dir: str = dataclasses.field(default="", metadata={"help": "child logs (default: a temp dir)"})
    secure: bool = dataclasses.field(default=False, metadata={
        "help": "mutual TLS (certs from scripts/make-dev-ca.sh) + gateway and admin tokens on every service"})
    cert_dir: str = dataclasses.field(default="", metadata={
        "help": "with --secure: the certificates of scripts/make-dev-ca.sh DIR (default: fresh ones)"})
    seed: int = 0
    gateway_args: str = dataclasses.field(default="", metadata={"help": "extra gateway flags, one string"})


def load(name: str):
    if name not in DRILLS:
        raise KeyError(f"unknown drill {name!r}; drills: {', '.join(DRILLS)}")
    return importlib.import_module(f"kvpager_tools.drills.{DRILLS[name]}")


def dev_certs(directory: Path) -> Path:
    """Runs scripts/make-dev-ca.sh into ``directory`` (needs a source checkout and openssl)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "make-dev-ca.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: --secure needs a source checkout")
    subprocess.run(["bash", str(script), str(directory)], check=True, stdout=subprocess.DEVNULL)
    return directory


def secure_config(cert_dir: Path):
    """mTLS everywhere (one cert per service for both roles) and random tokens."""
    from kvpager.security import SecurityConfig

    return SecurityConfig(
        tls_cert=str(cert_dir / "server.crt"), tls_key=str(cert_dir / "server.key"), tls_ca=str(cert_dir / "ca.crt"),
        tls_require_client_auth=True, tls_client_cert=str(cert_dir / "server.crt"),
        tls_client_key=str(cert_dir / "server.key"), auth_token=secrets.token_urlsafe(24),
        admin_token=secrets.token_urlsafe(24))


@contextlib.contextmanager
def drill_stack(needs: Needs, options: StackOptions | None = None, **config_overrides):
    """A running stack for ``needs`` as a DrillEnv; stopped (with its Redis) on exit.

    Raises:
        kvpager_tools.stack.StackError: a service did not come up.
        FileNotFoundError: Redis is needed and redis-server is missing.
    """
    from kvpager_tools.stack import Stack, StackConfig

    opts = options or StackOptions()
    redis = None
    tmp = tempfile.TemporaryDirectory(prefix="kvpager-drill-")
    stack = None
    try:
        if needs.redis:
            from kvpager_tools.redis_server import RedisServer

            redis = RedisServer().start()
        extra = {"executor": ["--max-model-len", str(opts.max_model_len)],
                 "gateway": opts.gateway_args.split() if opts.gateway_args else []}
        if redis is not None:
            # Only the memory service mirrors; the gateway keeps scoring by ScorePrefix.
            extra["memory"] = ["--redis-url", redis.url]
        certs = Path(opts.cert_dir) if opts.cert_dir else None
        security = secure_config(certs or dev_certs(Path(tmp.name) / "certs")) if opts.secure else None
        config = StackConfig(
            model=opts.model or None, num_executors=max(opts.executors, needs.executors),
            num_blocks=opts.num_blocks, block_size=opts.block_size, swap_blocks=opts.swap_blocks,
            log_dir=opts.log_dir or None, extra_args=extra, security=security, grace_s=5.0,
            **config_overrides).on_free_ports()
        stack = Stack(config).start()
        yield DrillEnv(stack=stack, redis=redis, seed=opts.seed)
    finally:
        if stack is not None:
            stack.stop()
        if redis is not None:
            redis.close()
        tmp.cleanup()


async def run_async(env: DrillEnv, module, opts) -> DrillResult:
    """Runs one drill on ``env`` and the common end checks."""
    env.open()
    t0 = time.monotonic()
    try:
        result = await module.run(env, opts)
        await env.finish(result)
    finally:
        await env.close()
    result.duration_s = time.monotonic() - t0
    return result


def run_drill(env: DrillEnv, name: str, **options) -> DrillResult:
    """Runs drill ``name`` with its defaults overridden by ``options``."""
    module = load(name)
    return asyncio.run(run_async(env, module, dataclasses.replace(module.Options(), **options)))


# --- flags from option dataclasses ----------------------------------------------------------------------


def add_option_flags(p: argparse.ArgumentParser, cls, title: str) -> None:
    g = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if isinstance(f.default, bool):
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_ or None)
        else:
            g.add_argument(flag, dest=f.name, type=type(f.default), default=f.default,
                           help=f"{help_} (default: %(default)s)".strip())


def options_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
