"""kvpager.security: flags, environment tokens, configs, and the dev CA script."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from kvpager.security import (
    ADMIN_TOKEN_ENV,
    AUTH_TOKEN_ENV,
    READ_ONLY_TOKEN_ENV,
    SecurityConfig,
    add_security_arguments,
    memory_auth,
    security_from_args,
)


def parse(argv, **kw):
    p = argparse.ArgumentParser()
    add_security_arguments(p, **kw)
    return security_from_args(p.parse_args(argv))


def test_no_flags_is_plaintext_without_tokens(monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    sec = parse([], auth_token=True, admin_token=True)
    assert sec.server_tls() is None and sec.client_tls() is None
    assert sec.auth_token is None and sec.admin_token is None and not sec.enabled


def test_tokens_from_environment_and_flags(monkeypatch):
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "admin-env")
    sec = parse([], auth_token=True, admin_token=True)
    assert (sec.auth_token, sec.admin_token) == ("from-env", "admin-env")
    assert parse(["--auth-token", "flag"], auth_token=True).auth_token == "flag"
    # A service without the auth flag never picks the client token up.
    assert parse([], admin_token=True).auth_token is None


def test_tokens_never_in_repr_or_argv():
    sec = SecurityConfig(auth_token="s3cret-a", admin_token="s3cret-b", open_read_only=True)
    assert "s3cret" not in repr(sec)
    for role in ("memory", "executor", "gateway"):
        assert not any("s3cret" in a for a in sec.child_args(role))
    unset = {READ_ONLY_TOKEN_ENV: "", **{env + "_FILE": "" for env in (AUTH_TOKEN_ENV, ADMIN_TOKEN_ENV,
                                                                       READ_ONLY_TOKEN_ENV)}}
    assert sec.child_env() == {AUTH_TOKEN_ENV: "s3cret-a", ADMIN_TOKEN_ENV: "s3cret-b", **unset}
    assert sec.child_args("memory") == ["--open-read-only"] and sec.child_args("gateway") == []
    # inherited ones unset, files included: what the parent chose is what the child uses
    assert SecurityConfig().child_env() == {AUTH_TOKEN_ENV: "", ADMIN_TOKEN_ENV: "", **unset}


def test_inconsistent_flags_are_refused(dev_certs):
    cert, key, ca = (str(dev_certs / n) for n in ("server.crt", "server.key", "ca.crt"))
    with pytest.raises(ValueError, match="go together"):
        parse(["--tls-cert", cert])
    with pytest.raises(ValueError, match="go together"):
        parse(["--tls-client-cert", cert])
    with pytest.raises(ValueError, match="needs"):
        parse(["--tls-cert", cert, "--tls-key", key, "--tls-require-client-auth"])
    with pytest.raises(ValueError, match="no such file"):
        parse(["--tls-ca", str(dev_certs / "missing.crt")])
    with pytest.raises(ValueError, match="token"):
        SecurityConfig(admin_token="has space")


def test_tls_configs(dev_certs):
    cert, key, ca = (str(dev_certs / n) for n in ("server.crt", "server.key", "ca.crt"))
    sec = parse(["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca, "--tls-require-client-auth",
                 "--tls-client-cert", cert, "--tls-client-key", key])
    tls = sec.server_tls()
    assert (tls.cert_file, tls.key_file, tls.ca_file, tls.require_client_auth) == (cert, key, ca, True)
    client = sec.client_tls()
    assert (client.ca_file, client.cert_file, client.key_file) == (ca, cert, key)
    assert sec.child_args("executor") == ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca,
                                          "--tls-client-cert", cert, "--tls-client-key", key,
                                          "--tls-require-client-auth"]
    assert parse(["--tls-ca", ca], server=False).client_tls().cert_file is None  # server-only TLS trust


def test_memory_auth_opens_only_read_only_methods():
    assert memory_auth(None, True) is None
    closed, opened = memory_auth("t", False), memory_auth("t", True)
    for method in ("GetAccounting", "WatchAccounting", "ScorePrefix", "ListExecutors"):
        assert not closed.is_open(f"/kvpager.v1.MemoryService/{method}")
        assert opened.is_open(f"/kvpager.v1.MemoryService/{method}")
    for method in ("RegisterExecutor", "DeregisterExecutor", "Heartbeat", "Step", "Fork", "Free"):
        assert not opened.is_open(f"/kvpager.v1.MemoryService/{method}")
    assert opened.is_open("/grpc.health.v1.Health/Check")


def test_dev_ca_script(dev_certs):
    """Server cert: SANs localhost/127.0.0.1/::1 and both EKUs; client cert: clientAuth; all chain to the CA."""
    text = subprocess.run(["openssl", "x509", "-in", str(dev_certs / "server.crt"), "-noout", "-text"],
                          capture_output=True, text=True, check=True).stdout
    assert "DNS:localhost" in text and "IP Address:127.0.0.1" in text
    assert "TLS Web Server Authentication" in text and "TLS Web Client Authentication" in text
    ok = subprocess.run(["openssl", "verify", "-CAfile", str(dev_certs / "ca.crt"), str(dev_certs / "server.crt"),
                         str(dev_certs / "client.crt")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert (dev_certs / "server.key").stat().st_mode & 0o077 == 0  # keys are private


def test_tokens_from_files(tmp_path, monkeypatch):
    from kvpager.security import ADMIN_TOKEN_ENV, READ_ONLY_TOKEN_ENV

    for env in (ADMIN_TOKEN_ENV, AUTH_TOKEN_ENV, READ_ONLY_TOKEN_ENV):
        monkeypatch.delenv(env, raising=False)
        monkeypatch.delenv(env + "_FILE", raising=False)
    (tmp_path / "admin").write_text("from-the-flag-file\n")  # echo's newline dropped
    (tmp_path / "env").write_text("  from-the-env-file  ")
    (tmp_path / "empty").write_text("\n")
    sec = parse(["--admin-token-file", str(tmp_path / "admin")], admin_token=True)
    assert sec.admin_token == "from-the-flag-file"
    monkeypatch.setenv(ADMIN_TOKEN_ENV + "_FILE", str(tmp_path / "env"))
    assert parse([], admin_token=True).admin_token == "from-the-env-file"
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "from-the-variable")  # the variable before its _FILE form
    assert parse([], admin_token=True).admin_token == "from-the-variable"
    assert parse(["--admin-token", "flag"], admin_token=True).admin_token == "flag"  # the flag first
    with pytest.raises(ValueError, match=r"--admin-token-file .*empty: the file is empty"):
        parse(["--admin-token-file", str(tmp_path / "empty")], admin_token=True)
    monkeypatch.delenv(ADMIN_TOKEN_ENV)
    monkeypatch.setenv(ADMIN_TOKEN_ENV + "_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"\$KVPAGER_ADMIN_TOKEN_FILE .*missing: No such file"):
        parse([], admin_token=True)
