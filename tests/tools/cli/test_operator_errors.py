"""Errors an operator can act on: each wrong input is one line on stderr
naming the flag, exit code 2, no traceback (default log level); and clean
exits log no error. Real commands in subprocesses, as an operator runs them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


def kvpager(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_") or k == "KVPAGER_HOME"}
    return subprocess.run([sys.executable, "-m", "kvpager_tools.cli", *argv], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    (root / "empty").mkdir()
    (root / "gpt2").mkdir()
    (root / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "not-pem.crt").write_text("hello\n")
    return {p.name: p for p in root.iterdir()}


def one_line(out: subprocess.CompletedProcess, prefix: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


def test_wrong_model_paths(bad_models):
    line = one_line(kvpager("executor", "--model", "/no/such/dir", "--port", "0"), "kvpager executor: --model ")
    assert line.endswith("/no/such/dir: no such directory (a local Hugging Face checkpoint directory)")
    line = one_line(kvpager("executor", "--model", str(bad_models["empty"]), "--port", "0"), "kvpager executor:")
    assert "--model" in line and "no config.json there" in line
    line = one_line(kvpager("executor", "--model", str(bad_models["broken"]), "--port", "0"), "kvpager executor:")
    assert "--model" in line and "config.json does not parse" in line
    line = one_line(kvpager("gateway", "--model", "/no/such/dir", "--port", "0", "--http-port", "0"),
                    "kvpager gateway: --model /no/such/dir: no such directory")
    one_line(kvpager("up", "--model", "/no/such/dir"), "kvpager up: --model /no/such/dir: no such directory")
    (bad_models["broken"] / "config.json").write_text("{}")  # now a config, but still no tokenizer
    line = one_line(kvpager("gateway", "--model", str(bad_models["broken"]), "--port", "0", "--http-port", "0"),
                    "kvpager gateway: --model")
    assert "no tokenizer there" in line


def test_unsupported_architecture(bad_models):
    line = one_line(kvpager("executor", "--model", str(bad_models["gpt2"]), "--port", "0"), "kvpager executor:")
    assert "--model" in line and "unsupported architecture: model_type 'gpt2'" in line
    assert "GPT2LMHeadModel" in line and "llama" in line  # what it is, and what would work


def test_port_in_use(busy_port, demo_checkpoint):
    one_line(kvpager("memory", "--port", str(busy_port)),
             f"kvpager memory: --port {busy_port}: cannot listen on 127.0.0.1:{busy_port}: already in use")
    one_line(kvpager("memory", "--port", "0", "--http-port", str(busy_port)),
             f"kvpager memory: --http-port {busy_port}")
    one_line(kvpager("executor", "--model", demo_checkpoint, "--port", str(busy_port)),
             f"kvpager executor: --port {busy_port}: cannot listen")
    one_line(kvpager("gateway", "--model", demo_checkpoint, "--port", "0", "--http-port", str(busy_port)),
             f"kvpager gateway: --http-port {busy_port}: cannot listen")
    one_line(kvpager("up", "--model", demo_checkpoint, "--gateway-port", str(busy_port), "--memory-port", "0",
                     "--http-port", "0", "--blockmap-port", "0", "--executor-base-port", "0"),
             f"kvpager up: gateway: --gateway-port: port {busy_port} is already in use")


def test_bad_tls_files(bad_models):
    bad = str(bad_models["not-pem.crt"])
    line = one_line(kvpager("memory", "--port", "0", "--tls-cert", bad, "--tls-key", bad), "kvpager memory: --tls-cert")
    assert "not a PEM certificate and its matching private key" in line
    one_line(kvpager("memory", "--port", "0", "--tls-ca", bad), f"kvpager memory: --tls-ca {bad}: not a PEM CA")
    one_line(kvpager("gateway", "--model", "/m", "--tls-ca", "/no/ca.crt"),
             "kvpager gateway: --model /m: no such directory")  # the model is checked first
    one_line(kvpager("memory", "--port", "0", "--tls-cert", "/no/cert.pem", "--tls-key", bad),
             "kvpager memory: --tls-cert /no/cert.pem: no such file")
    one_line(kvpager("memory", "--port", "0", "--admin-token-file", "/no/token"),
             "kvpager memory: --admin-token-file /no/token: No such file or directory")


def test_clean_exit_logs_no_error():
    proc = subprocess.Popen([sys.executable, "-m", "kvpager_tools.cli", "memory", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    first = proc.stderr.readline()  # "server started"
    assert "server started" in first, first
    address = json.loads(first)["address"]
    while kvpager("health", "--address", address).returncode != 0:  # serving: its signal handlers are set
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 0
    for line in (first + rest).splitlines():
        record = json.loads(line)  # JSON log lines only: no traceback, no stray output
        assert record["level"] in ("info", "debug"), line


@pytest.mark.timeout(300)
def test_bench_executor_exits_without_an_error(demo_checkpoint):
    out = kvpager("bench", "executor", "--models", demo_checkpoint, "--batch-sizes", "1", "--context-len", "8",
                  "--repeats", "1", "--warmup", "0", "--json", timeout=280)
    assert out.returncode == 0, out.stderr
    json.loads(out.stdout)
    for line in out.stderr.splitlines():
        assert "Error" not in line and "Traceback" not in line, line
        record = json.loads(line)  # only the executor's own JSON log lines
        assert record["level"] in ("info", "warning"), line
