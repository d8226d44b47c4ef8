"""TLS and token flags shared by every CLI, and the configs they build.

Two secrets, two audiences:

* the **auth token** (``--auth-token`` or ``$KVPAGER_AUTH_TOKEN``): what the
  gateway requires from its clients (``authorization: Bearer <token>``);
* the **admin token** (``--admin-token`` or ``$KVPAGER_ADMIN_TOKEN``): between
  services. The memory service requires it (for everything, or only for its
  mutating RPCs with ``--open-read-only``), executors require it for Execute /
  GetInfo / ConfirmPool, and the gateway and executors send it upstream.
  ``kvpager blocks`` sends it too.

Prefer the environment variables to the flags: a flag's value shows in
``ps``. ``kvpager up`` hands tokens to its children through the environment.

TLS: a server serves TLS with ``--tls-cert/--tls-key`` and requires client
certificates (mTLS) with ``--tls-require-client-auth`` (verified against
``--tls-ca``). Outgoing channels use TLS when ``--tls-ca`` (the root that
signed the servers) or ``--tls-client-cert/--tls-client-key`` (mTLS) are
given. ``scripts/make-dev-ca.sh`` writes a local CA and certs for
127.0.0.1/localhost; see docs/security.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from kvpager.auth import TokenAuth
from kvpager.channel import ClientTls
from kvpager.server import TlsConfig

__all__ = [
    "ADMIN_TOKEN_ENV", "AUTH_TOKEN_ENV", "MEMORY_READ_ONLY_METHODS", "SecurityConfig", "add_client_tls_arguments",
    "add_security_arguments", "admin_token_from_args", "auth_token_from_args", "client_tls_from_args",
    "memory_auth", "security_from_args", "server_tls_from_args", "token_auth",
]

AUTH_TOKEN_ENV = "KVPAGER_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "KVPAGER_ADMIN_TOKEN"

# Readable without the admin token when the memory service runs --open-read-only.
MEMORY_READ_ONLY_METHODS = frozenset(
    f"/kvpager.v1.MemoryService/{m}" for m in ("GetAccounting", "WatchAccounting", "ScorePrefix", "ListExecutors")
)


@dataclasses.dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Everything a service (or ``kvpager up``) needs for TLS and tokens.

    Tokens never appear in ``repr`` (configs get logged) nor in ``child_args``
    (argv is public); ``child_env`` carries them to child processes.
    """

    tls_cert: str | None = None                 # server certificate (PEM)
    tls_key: str | None = None                  # its private key
    tls_ca: str | None = None                   # CA: verifies client certs (server) and servers (client)
    tls_require_client_auth: bool = False       # mTLS on the servers
    tls_client_cert: str | None = None          # certificate presented on outgoing channels
    tls_client_key: str | None = None
    tls_server_name: str | None = None          # override the name checked on outgoing channels
    auth_token: str | None = dataclasses.field(default=None, repr=False)   # gateway clients
    admin_token: str | None = dataclasses.field(default=None, repr=False)  # between services
    open_read_only: bool = False                # memory: read-only RPCs need no admin token

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_require_client_auth and not (self.tls_cert and self.tls_ca):
            raise ValueError("--tls-require-client-auth needs --tls-cert, --tls-key and --tls-ca")
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_cert", "tls_client_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')}: no such file {path!r}")
        for name in ("auth_token", "admin_token"):
            token = getattr(self, name)
            if token is not None and (not token or not token.isprintable() or " " in token):
                raise ValueError(f"{name.replace('_', ' ')} must be a non-empty printable string without spaces")

    def server_tls(self) -> TlsConfig | None:
        if not self.tls_cert:
            return None
        return TlsConfig(self.tls_cert, self.tls_key, ca_file=self.tls_ca,
                         require_client_auth=self.tls_require_client_auth)

    def client_tls(self) -> ClientTls | None:
        if not (self.tls_ca or self.tls_client_cert):
            return None
        return ClientTls(ca_file=self.tls_ca, cert_file=self.tls_client_cert, key_file=self.tls_client_key,
                         server_name=self.tls_server_name)

    def child_args(self, role: str) -> list[str]:
        """CLI flags for a ``kvpager <role>`` child (no secrets)."""
        out: list[str] = []
        for flag, value in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca),
                            ("--tls-client-cert", self.tls_client_cert),
                            ("--tls-client-key", self.tls_client_key),
                            ("--tls-server-name", self.tls_server_name)):
            if value:
                out += [flag, value]
        if self.tls_require_client_auth:
            out.append("--tls-require-client-auth")
        if role == "memory" and self.open_read_only:
            out.append("--open-read-only")
        return out

    def child_env(self) -> dict[str, str]:
        """Environment for child processes: the tokens (absent ones unset)."""
        return {ADMIN_TOKEN_ENV: self.admin_token or "", AUTH_TOKEN_ENV: self.auth_token or ""}

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert or self.tls_ca or self.tls_client_cert or self.auth_token or self.admin_token)


# --- flags -----------------------------------------------------------------------------------------------


def add_security_arguments(p: argparse.ArgumentParser, *, server: bool = True, client: bool = True,
                           auth_token: bool = False, admin_token: bool = False,
                           open_read_only: bool = False) -> None:
    """Adds the TLS flags (server side and/or outgoing channels) and, on
    request, the token flags. ``security_from_args`` reads them back."""
    g = p.add_argument_group("TLS and authentication (docs/security.md)")
    if server:
        g.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
        g.add_argument("--tls-key", default=None, help="private key of --tls-cert (PEM)")
        g.add_argument("--tls-require-client-auth", action="store_true",
                       help="mutual TLS: require client certificates signed by --tls-ca")
    if server or client:
        g.add_argument("--tls-ca", default=None,
                       help="CA certificate (PEM): verifies client certificates on this server"
                            + (" and the servers this one connects to (TLS on outgoing channels)" if client else ""))
    if client:
        g.add_argument("--tls-client-cert", default=None,
                       help="certificate presented on outgoing channels (mutual TLS)")
        g.add_argument("--tls-client-key", default=None, help="private key of --tls-client-cert")
        g.add_argument("--tls-server-name", default=None,
                       help="name checked against the servers' certificates (default: the host connected to)")
    if auth_token:
        g.add_argument("--auth-token", default=None,
                       help=f"require this bearer token from clients (default: ${AUTH_TOKEN_ENV}; prefer the "
                            "variable, argv is visible to other users)")
    if admin_token:
        g.add_argument("--admin-token", default=None,
                       help=f"token between services: required by this service and sent to the ones it calls "
                            f"(default: ${ADMIN_TOKEN_ENV})")
    if open_read_only:
        g.add_argument("--open-read-only", action="store_true",
                       help="with an admin token: GetAccounting, WatchAccounting, ScorePrefix and ListExecutors "
                            "need no token (default: every RPC needs it)")


def add_client_tls_arguments(p: argparse.ArgumentParser) -> None:
    """TLS flags of a pure client (``kvpager generate``, ``kvpager blocks``)."""
    add_security_arguments(p, server=False, client=True)


def _token(value: str | None, env: str) -> str | None:
    return value or os.environ.get(env) or None


def auth_token_from_args(args: argparse.Namespace) -> str | None:
    return _token(getattr(args, "auth_token", None), AUTH_TOKEN_ENV)


def admin_token_from_args(args: argparse.Namespace) -> str | None:
    return _token(getattr(args, "admin_token", None), ADMIN_TOKEN_ENV)


def security_from_args(args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig of parsed flags (and the token variables).

    Raises:
        ValueError: an inconsistent combination (a cert without its key …).
    """
    return SecurityConfig(
        tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
        tls_ca=getattr(args, "tls_ca", None), tls_require_client_auth=getattr(args, "tls_require_client_auth", False),
        tls_client_cert=getattr(args, "tls_client_cert", None), tls_client_key=getattr(args, "tls_client_key", None),
        tls_server_name=getattr(args, "tls_server_name", None),
        auth_token=auth_token_from_args(args) if hasattr(args, "auth_token") else None,
        admin_token=admin_token_from_args(args) if hasattr(args, "admin_token") else None,
        open_read_only=getattr(args, "open_read_only", False))


def server_tls_from_args(args: argparse.Namespace) -> TlsConfig | None:
    return security_from_args(args).server_tls()


def client_tls_from_args(args: argparse.Namespace) -> ClientTls | None:
    return security_from_args(args).client_tls()


# --- server-side checks -----------------------------------------------------------------------------------


def token_auth(token: str | None, open_methods: frozenset[str] = frozenset(),
               also: tuple[str, ...] = ()) -> TokenAuth | None:
    """A TokenAuth interceptor, or None when no token is configured (``also``: more accepted tokens)."""
    return TokenAuth(token or "", open_methods=open_methods, also=also) if token or also else None


def memory_auth(admin_token: str | None, open_read_only: bool) -> TokenAuth | None:
    """The memory service's check: the admin token for every RPC, or only for
    the mutating ones (Register/Deregister/Heartbeat/Step/Fork/Free) when
    ``open_read_only``."""
    return token_auth(admin_token, MEMORY_READ_ONLY_METHODS if open_read_only else frozenset())
