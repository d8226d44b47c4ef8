"""grpc's C core stays off our stderr unless the operator asks for it.

The services log JSON lines only; grpc (through absl) prints plain-text
INFO lines when GRPC_VERBOSITY is unset. GRPC_TRACE=api makes it print
dozens of them on every call, so it shows whether the entry points set the
verbosity before grpc loads: with it unset the lines must be gone, with
GRPC_VERBOSITY=INFO (the operator's choice) they must be there. Real
processes, started as an operator starts them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from kvpager.grpc_logging import DEFAULT_VERBOSITY, VERBOSITY_ENV, quiet_grpc_core

ABSL_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")  # "I1204 12:25:01.238427 28177 file.cc:1403] ..."


def _env(verbosity: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k != VERBOSITY_ENV and (not k.startswith("KVPAGER_") or k == "KVPAGER_HOME")}
    env["GRPC_TRACE"] = "api"
    if verbosity is not None:
        env[VERBOSITY_ENV] = verbosity
    return env


def _health(address: str, verbosity: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpager_tools.cli", "health", "--address", address],
                          capture_output=True, text=True, timeout=60, env=_env(verbosity), check=False)


def test_quiet_grpc_core_keeps_an_operators_choice(monkeypatch):
    monkeypatch.delenv(VERBOSITY_ENV, raising=False)
    assert quiet_grpc_core() == DEFAULT_VERBOSITY == os.environ[VERBOSITY_ENV]
    monkeypatch.setenv(VERBOSITY_ENV, "DEBUG")
    assert quiet_grpc_core() == "DEBUG" == os.environ[VERBOSITY_ENV]


def test_the_operators_verbosity_lets_grpc_trace_through():
    # The control: the tracer does print here, so the quiet case below can fail.
    out = _health("127.0.0.1:1", "INFO")
    assert out.returncode != 0
    assert sum(bool(ABSL_LINE.match(line)) for line in out.stderr.splitlines()) >= 5, out.stderr


def test_service_and_cli_entry_points_keep_grpc_quiet():
    proc = subprocess.Popen([sys.executable, "-m", "memory_service", "--port", "0"], env=_env(None),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()
        assert "server started" in first, first
        address = json.loads(first)["address"]
        deadline = time.monotonic() + 60
        while (health := _health(address, None)).returncode != 0:  # RPCs went through grpc's traced API
            assert time.monotonic() < deadline, health.stderr
            time.sleep(0.2)
        assert not any(ABSL_LINE.match(line) for line in health.stderr.splitlines()), health.stderr
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    for line in (first + rest).splitlines():
        json.loads(line)  # the service's JSON lines and nothing of grpc's
