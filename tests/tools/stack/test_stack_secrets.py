"""The tokens `kvpager up` generates, and the supervisor's backoff (pure parts)."""

from __future__ import annotations

import stat

import pytest

from kvpager.security import SecurityConfig
from kvpager_tools.stack_secrets import is_loopback, with_generated_tokens
from kvpager_tools.supervisor import Backoff


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_loopback_stack_gets_an_admin_token_and_open_read_only(tmp_path):
    sec = with_generated_tokens(None, "127.0.0.1", tmp_path / "secrets")
    assert sec.admin_token and len(sec.admin_token) >= 32 and sec.open_read_only and sec.read_only_token is None
    assert (tmp_path / "secrets" / "admin_token").read_text() == sec.admin_token + "\n"
    assert mode(tmp_path / "secrets" / "admin_token") == 0o600 and mode(tmp_path / "secrets") == 0o700
    assert not (tmp_path / "secrets" / "read_only_token").exists()
    assert with_generated_tokens(None, "127.0.0.1", tmp_path / "again").admin_token != sec.admin_token


def test_a_stack_off_loopback_gets_a_read_only_token_too(tmp_path):
    sec = with_generated_tokens(None, "0.0.0.0", tmp_path)
    assert sec.admin_token and sec.read_only_token and sec.read_only_token != sec.admin_token
    assert not sec.open_read_only
    assert (tmp_path / "read_only_token").read_text().strip() == sec.read_only_token
    assert mode(tmp_path / "read_only_token") == 0o600


def test_the_operators_tokens_are_kept(tmp_path):
    given = SecurityConfig(admin_token="mine")
    assert with_generated_tokens(given, "0.0.0.0", tmp_path) is given
    assert not any(tmp_path.iterdir())
    sec = with_generated_tokens(SecurityConfig(open_read_only=True), "0.0.0.0", tmp_path)
    assert sec.open_read_only and sec.read_only_token is None  # asked for open read-only: no read-only token


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.0.0.5", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                ("10.0.0.5", False), ("myhost", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_backoff_doubles_while_a_child_keeps_failing_and_resets_once_stable():
    backoff = Backoff(initial_s=1.0, max_s=8.0, stable_s=60.0)
    delays, last = [], None
    for _ in range(6):
        last = backoff.delay_s(last, uptime_s=2.0)
        delays.append(last)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.delay_s(8.0, uptime_s=61.0) == 1.0
    with pytest.raises(ValueError):
        Backoff(initial_s=0)
    with pytest.raises(ValueError):
        Backoff(initial_s=5, max_s=1)
