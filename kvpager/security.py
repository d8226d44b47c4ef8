"""TLS and token flags shared by every CLI, and the configs they build.

Two secrets, two audiences:

* the **auth token** (``--auth-token`` or ``$KVPAGER_AUTH_TOKEN``): what the
  gateway requires from its clients (``authorization: Bearer <token>``);
* the **admin token** (``--admin-token`` or ``$KVPAGER_ADMIN_TOKEN``): between
  services. The memory service requires it (for everything, or only for its
  mutating RPCs with ``--open-read-only``), executors require it for Execute /
  GetInfo / ConfirmPool, and the gateway and executors send it upstream.
  ``kvpager blocks`` sends it too;
* the **read-only token** (``--read-only-token``, memory service only): opens
  the read-only RPCs and the block map, nothing that mutates.

Each token also comes from a file (``--admin-token-file`` or
``$KVPAGER_ADMIN_TOKEN_FILE``, e.g. ``/run/secrets/admin_token``, as Docker
secrets mount them). Prefer the variables or files to the flags: a flag's
value shows in ``ps``. ``kvpager up`` generates an admin token unless given
one and hands tokens to its children through the environment.

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
from kvpager.preflight import check_tls_files
from kvpager.server import TlsConfig

__all__ = [
    "ADMIN_TOKEN_ENV", "AUTH_TOKEN_ENV", "MEMORY_READ_ONLY_METHODS", "READ_ONLY_TOKEN_ENV", "SecurityConfig",
    "add_client_tls_arguments", "add_security_arguments", "admin_token_from_args", "auth_token_from_args", "client_tls_from_args",
    "memory_auth", "read_only_token_from_args", "read_token_file", "security_from_args",
    "server_tls_from_args", "token_auth",
]

AUTH_TOKEN_ENV = "KVPAGER_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "KVPAGER_ADMIN_TOKEN"
READ_ONLY_TOKEN_ENV = "KVPAGER_READ_ONLY_TOKEN"
FILE_SUFFIX = "_FILE"  # $KVPAGER_ADMIN_TOKEN_FILE: a file holding the token (Docker secrets)

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
    read_only_token: str | None = dataclasses.field(default=None, repr=False)  # memory: read-only RPCs only
    open_read_only: bool = False                # memory: read-only RPCs need no admin token

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_require_client_auth and not (self.tls_cert and self.tls_ca):
            raise ValueError("--tls-require-client-auth needs --tls-cert, --tls-key and --tls-ca")
        # Loaded as the TLS stack will: a wrong path, a non-PEM file or a key that does not
        # match its certificate is one line naming the flag now, not a grpc error at bind time.
        check_tls_files(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca,
                        client_cert=self.tls_client_cert, client_key=self.tls_client_key)
        for name in ("auth_token", "admin_token", "read_only_token"):
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
        return {ADMIN_TOKEN_ENV: self.admin_token or "", AUTH_TOKEN_ENV: self.auth_token or "",
                READ_ONLY_TOKEN_ENV: self.read_only_token or "",
                # An inherited *_FILE must not override what the parent chose.
                ADMIN_TOKEN_ENV + FILE_SUFFIX: "", AUTH_TOKEN_ENV + FILE_SUFFIX: "",
                READ_ONLY_TOKEN_ENV + FILE_SUFFIX: ""}

    @property
    def enabled(self) -> bool:
        return bool(self.tls_cert or self.tls_ca or self.tls_client_cert or self.auth_token or self.admin_token)


# --- flags -----------------------------------------------------------------------------------------------


def add_security_arguments(p: argparse.ArgumentParser, *, server: bool = True, client: bool = True,
                           auth_token: bool = False, admin_token: bool = False,
                           open_read_only: bool = False, read_only_token: bool = False) -> None:
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
                            "variable or --auth-token-file, argv is visible to other users)")
        g.add_argument("--auth-token-file", default=None, metavar="FILE",
                       help=f"read --auth-token from FILE (default: ${AUTH_TOKEN_ENV}{FILE_SUFFIX})")
    if admin_token:
        g.add_argument("--admin-token", default=None,
                       help=f"token between services: required by this service and sent to the ones it calls "
                            f"(default: ${ADMIN_TOKEN_ENV}; prefer it or --admin-token-file)")
        g.add_argument("--admin-token-file", default=None, metavar="FILE",
                       help=f"read --admin-token from FILE, e.g. a Docker secret "
                            f"(default: ${ADMIN_TOKEN_ENV}{FILE_SUFFIX})")
    if read_only_token:
        g.add_argument("--read-only-token", default=None,
                       help=f"a second token accepted on the read-only RPCs only (GetAccounting, "
                            f"WatchAccounting, ScorePrefix, ListExecutors, the block map) "
                            f"(default: ${READ_ONLY_TOKEN_ENV})")
        g.add_argument("--read-only-token-file", default=None, metavar="FILE",
                       help=f"read --read-only-token from FILE (default: ${READ_ONLY_TOKEN_ENV}{FILE_SUFFIX})")
    if open_read_only:
        g.add_argument("--open-read-only", action="store_true",
                       help="with an admin token: GetAccounting, WatchAccounting, ScorePrefix and ListExecutors "
                            "need no token (default: every RPC needs it)")


def add_client_tls_arguments(p: argparse.ArgumentParser) -> None:
    """TLS flags of a pure client (``kvpager generate``, ``kvpager blocks``)."""
    add_security_arguments(p, server=False, client=True)


def read_token_file(path: str, flag: str) -> str:
    """The token in ``path`` (surrounding whitespace dropped: ``echo`` adds a newline).

    Raises:
        ValueError: unreadable or empty, naming ``flag``.
    """
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise ValueError(f"{flag} {path}: the file is empty")
    return token


def _token(args: argparse.Namespace, name: str, env: str) -> str | None:
    """A token from, first to last: its flag, its file flag, ``$ENV``, ``$ENV_FILE``."""
    flag = "--" + name.replace("_", "-")
    if value := getattr(args, name, None):
        return value
    if path := getattr(args, f"{name}_file", None):
        return read_token_file(path, f"{flag}-file")
    if value := os.environ.get(env):
        return value
    if path := os.environ.get(env + FILE_SUFFIX):
        return read_token_file(path, f"${env}{FILE_SUFFIX}")
    return None


def auth_token_from_args(args: argparse.Namespace) -> str | None:
    return _token(args, "auth_token", AUTH_TOKEN_ENV)


def admin_token_from_args(args: argparse.Namespace) -> str | None:
    return _token(args, "admin_token", ADMIN_TOKEN_ENV)


def read_only_token_from_args(args: argparse.Namespace) -> str | None:
    return _token(args, "read_only_token", READ_ONLY_TOKEN_ENV)


def _tls_flag(args: argparse.Namespace, name: str) -> str | None:
    """A TLS flag's value, else ``$KVPAGER_<NAME>`` when the command has that flag
    (containers configure TLS by environment: docker-compose.tls.yml)."""
    if not hasattr(args, name):
        return None
    return getattr(args, name) or os.environ.get(f"KVPAGER_{name.upper()}") or None


def security_from_args(args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig of parsed flags (and the token and TLS variables:
    ``$KVPAGER_TLS_CERT``, ``_KEY``, ``_CA``, ``_CLIENT_CERT``, ``_CLIENT_KEY``,
    ``_SERVER_NAME``, ``$KVPAGER_TLS_REQUIRE_CLIENT_AUTH=1``).

    Raises:
        ValueError: an inconsistent combination (a cert without its key …).
    """
    require = getattr(args, "tls_require_client_auth", False) or (
        hasattr(args, "tls_require_client_auth") and os.environ.get("KVPAGER_TLS_REQUIRE_CLIENT_AUTH") == "1")
    return SecurityConfig(
        tls_cert=_tls_flag(args, "tls_cert"), tls_key=_tls_flag(args, "tls_key"),
        tls_ca=_tls_flag(args, "tls_ca"), tls_require_client_auth=require,
        tls_client_cert=_tls_flag(args, "tls_client_cert"), tls_client_key=_tls_flag(args, "tls_client_key"),
        tls_server_name=_tls_flag(args, "tls_server_name"),
        auth_token=auth_token_from_args(args) if hasattr(args, "auth_token") else None,
        admin_token=admin_token_from_args(args) if hasattr(args, "admin_token") else None,
        read_only_token=read_only_token_from_args(args) if hasattr(args, "read_only_token") else None,
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


def memory_auth(admin_token: str | None, open_read_only: bool,
                read_only_token: str | None = None) -> TokenAuth | None:
    """The memory service's check: the admin token for every RPC, or only for
    the mutating ones (Register/Deregister/Heartbeat/Step/Fork/Free) when
    ``open_read_only``; ``read_only_token`` is accepted on the read-only ones.

    Raises:
        ValueError: a read-only token without an admin token (it would open nothing).
    """
    if read_only_token and not admin_token:
        raise ValueError("--read-only-token needs an admin token (without one every RPC is open)")
    if admin_token is None:
        return None
    return TokenAuth(admin_token, MEMORY_READ_ONLY_METHODS if open_read_only else frozenset(),
                     read_only_token=read_only_token, read_only_methods=MEMORY_READ_ONLY_METHODS)
