"""Checks an operator's flags before a service starts, and the one-line
report of what is wrong.

A wrong model path, a missing ``config.json``, an architecture we cannot
serve, a port someone else holds or a TLS file that is not PEM would
otherwise surface minutes later as a library traceback (transformers'
``HFValidationError``, grpc's bind failure). Each check here raises
``UsageError`` naming the flag; the CLI prints it as one line on stderr
and exits 2, the conventional "usage error" code (``report``).
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["USAGE_EXIT_CODE", "BindError", "UsageError", "check_model_dir", "check_port_free", "check_tls_files",
           "report"]

USAGE_EXIT_CODE = 2


class UsageError(ValueError):
    """An operator's input that cannot work; the message names the flag."""


class BindError(OSError, UsageError):
    """A server could not listen where it was told (a port in use)."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def check_model_dir(path: str, *, flag: str = "--model", supported: Iterable[str] | None = None,
                    tokenizer: bool = False) -> Path:
    """The checkpoint directory, checked: it exists, holds a parseable
    ``config.json``, (when ``supported`` is given) a model type in it, and
    (with ``tokenizer``) a tokenizer's files.

    Raises:
        UsageError: what is wrong, naming ``flag``.
    """
    model = Path(path)
    if not model.exists():
        raise UsageError(f"{flag} {path}: no such directory (a local Hugging Face checkpoint directory)")
    if not model.is_dir():
        raise UsageError(f"{flag} {path}: not a directory (a local Hugging Face checkpoint directory)")
    config_path = model / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{flag} {path}: no config.json there (not a Hugging Face checkpoint directory)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{flag} {path}: config.json does not parse ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag} {path}: config.json is not a JSON object")
    if supported is not None:
        supported = tuple(supported)
        model_type = config.get("model_type")  # what the executor's loader checks, too
        if model_type not in supported:
            archs = ", ".join(config.get("architectures") or []) or "none given"
            raise UsageError(f"{flag} {path}: unsupported architecture: model_type {model_type!r} "
                             f"(architectures: {archs}); supported model types: {', '.join(supported)}")
    if tokenizer and not any((model / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{flag} {path}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")
    return model


def check_port_free(host: str, port: int | None, *, flag: str) -> None:
    """Raises UsageError when ``host:port`` cannot be bound now (port 0 and
    None always pass). The service binds it for real moments later; this only
    turns the common case, a port already taken, into a clear message."""
    if not port:
        return
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As a server binds: SO_REUSEADDR lets a port in TIME_WAIT be reused, a listener still refuses.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            reason = "already in use" if exc.errno in (98, 48) else exc.strerror or str(exc)
            raise UsageError(f"{flag} {port}: cannot listen on {host}:{port}: {reason}") from None


def check_tls_files(*, cert: str | None = None, key: str | None = None, ca: str | None = None,
                    client_cert: str | None = None, client_key: str | None = None) -> None:
    """Loads each given PEM file as the TLS stack will, so a wrong path, a
    file that is not PEM or a key that does not match its certificate is
    reported here, naming its flag.

    Raises:
        UsageError: the first file that does not load.
    """
    for cert_flag, cert_path, key_flag, key_path in (("--tls-cert", cert, "--tls-key", key),
                                                    ("--tls-client-cert", client_cert,
                                                     "--tls-client-key", client_key)):
        for flag, path in ((cert_flag, cert_path), (key_flag, key_path)):
            _readable(flag, path)
        if cert_path and key_path:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            try:
                context.load_cert_chain(cert_path, key_path)
            except ssl.SSLError as exc:
                raise UsageError(f"{cert_flag} {cert_path} / {key_flag} {key_path}: not a PEM certificate and "
                                 f"its matching private key ({exc.reason or exc})") from None
    if ca:
        _readable("--tls-ca", ca)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise UsageError(f"--tls-ca {ca}: not a PEM CA certificate ({exc.reason or exc})") from None


def _readable(flag: str, path: str | None) -> None:
    if path is None:
        return
    try:
        with open(path, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise UsageError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None


def report(prog: str, exc: BaseException) -> int:
    """Prints ``exc`` as the one line an operator sees and returns the exit code 2."""
    print(f"{prog}: {exc}", file=sys.stderr)
    return USAGE_EXIT_CODE
