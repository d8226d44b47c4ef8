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
from kvpager_tools.stack import StackOptions

# drill name -> module under kvpager_tools.drills
DRILLS = {
    "bad-input": "bad_input",
    "fuzz": "fuzz",
    "cancel": "cancel",
    "executor-kill": "executor_kill",
    "memory-restart": "memory_restart",
    "redis-kill": "redis_kill",
    "load": "load",
    "http-load": "http_load",
    "soak": "soak",
    "abuse": "abuse",
}


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a drill needs from its stack."""

    executors: int = 1
    redis: bool = False  # the memory service mirrors to a Redis the drill may kill

    def union(self, other: Needs) -> Needs:
        return Needs(max(self.executors, other.executors), self.redis or other.redis)


# The stack a drill runs on unless told otherwise (executors 0: what the drill needs).
DRILL_DEFAULTS = dict(executors=0, num_blocks=512, swap_blocks=128, max_model_len=512, log_level="INFO")


def drill_options(**options) -> StackOptions:
    """StackOptions with the drills' defaults, overridden by ``options``."""
    return StackOptions(**{**DRILL_DEFAULTS, **options})


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
    from kvpager_tools.stack import Stack

    opts = options or drill_options()
    redis = None
    tmp = tempfile.TemporaryDirectory(prefix="kvpager-drill-")
    stack = None
    try:
        if needs.redis:
            from kvpager_tools.redis_server import RedisServer

            redis = RedisServer().start()
        # Only the memory service mirrors; the gateway keeps scoring by ScorePrefix.
        extra = {"memory": ["--redis-url", redis.url]} if redis is not None else {}
        certs = Path(opts.cert_dir) if opts.cert_dir else None
        security = secure_config(certs or dev_certs(Path(tmp.name) / "certs")) if opts.secure else None
        config = opts.config(security=security, extra=extra, num_executors=max(opts.executors, needs.executors),
                             grace_s=5.0, **config_overrides)
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
        await env.learn_dtype()
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


def add_option_flags(p: argparse.ArgumentParser, cls, title: str, defaults: dict | None = None) -> None:
    g = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        default = (defaults or {}).get(f.name, f.default)
        if isinstance(f.default, bool):
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=help_ or None)
        else:
            g.add_argument(flag, dest=f.name, type=type(f.default), default=default,
                           help=f"{help_} (default: %(default)s)".strip())


def options_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
