"""The tokens `kvpager up` makes when it is given none (secure by default).

A local stack without an admin token lets any local process call
``MemoryService/Free(abort=True)`` on every running stream. So unless the
operator passed one, ``kvpager up`` generates a random admin token, writes
it to a file only its user can read (``<log dir>/secrets/admin_token``,
mode 600) and hands it to the children through their environment, never
their command line. The read-only RPCs (accounting, the block map) stay open
on a loopback stack; a stack listening elsewhere gets a generated read-only
token as well.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
from pathlib import Path

from kvpager.security import SecurityConfig

ADMIN_TOKEN_FILE = "admin_token"
READ_ONLY_TOKEN_FILE = "read_only_token"


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: not known to be loopback
        return False


def write_secret(path: Path, token: str) -> None:
    """``token`` into ``path``, readable by this user only (created 0600, never widened)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def with_generated_tokens(security: SecurityConfig | None, host: str, secrets_dir: Path) -> SecurityConfig:
    """``security`` unchanged when it has an admin token; else with a
    generated one and, for the read-only RPCs, ``open_read_only`` on loopback
    or a generated read-only token elsewhere (unless either was asked for).
    Generated tokens are written to ``secrets_dir``."""
    security = security or SecurityConfig()
    if security.admin_token:  # the operator's choice, read-only access included
        return security
    changes: dict = {"admin_token": secrets.token_urlsafe(32)}
    write_secret(secrets_dir / ADMIN_TOKEN_FILE, changes["admin_token"])
    if not security.read_only_token and not security.open_read_only:
        if is_loopback(host):
            changes["open_read_only"] = True  # only this machine's users reach it; they may look
        else:
            changes["read_only_token"] = secrets.token_urlsafe(32)
            write_secret(secrets_dir / READ_ONLY_TOKEN_FILE, changes["read_only_token"])
    return dataclasses.replace(security, **changes)
