"""`kvpager up` as an operator runs it: one real process tree on the demo
model, driven from outside. In order: the generated admin token (a file of
mode 600, in the children's environment, never their argv) and the
mutating RPCs that refuse calls without it; a SIGKILLed executor, then a
SIGKILLed memory service, restarted by the supervisor (counted in its
metrics) with the stack serving again; SIGTERM draining a stream in flight
to completion while new requests are refused, then stopping gateway,
executors, memory in that order."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvpager.channel import auth_metadata, make_channel
from kvpager.v1 import (
    common_pb2,
    executor_pb2,
    executor_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    memory_pb2,
    memory_pb2_grpc,
)
from kvpager_tools.stack import StackConfig

pytestmark = pytest.mark.timeout(900)

MEMORY_MUTATING = {
    "RegisterExecutor": memory_pb2.RegisterExecutorRequest(info=memory_pb2.ExecutorPoolInfo(
        executor_id="intruder", num_blocks=8, block_size=16)),
    "DeregisterExecutor": memory_pb2.DeregisterExecutorRequest(executor_id="executor-0"),
    "Heartbeat": memory_pb2.HeartbeatRequest(executor_id="executor-0"),
    "Step": memory_pb2.StepRequest(),
    "Fork": memory_pb2.ForkRequest(fork=common_pb2.ForkOp(parent_seq_id=1, child_seq_ids=[2])),
    "Free": memory_pb2.FreeRequest(seq_ids=[1, 2, 3], abort=True),
}
EXECUTOR_METHODS = {
    "Execute": executor_pb2.ExecuteRequest(),
    "ConfirmPool": executor_pb2.ConfirmPoolRequest(),
    "GetInfo": executor_pb2.GetInfoRequest(),
}


class Up:
    """A running `kvpager up` and what it printed."""

    def __init__(self, proc: subprocess.Popen, config: StackConfig, log_dir: Path) -> None:
        self.proc, self.config, self.log_dir = proc, config, log_dir
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if found := re.search(pattern, self.output()):
                return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not printed; output:\n{self.output()}")

    def children(self) -> dict[str, int]:
        """Child name -> pid, from /proc (memory, executor-0, gateway)."""
        out = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"memory_service" in argv:
                    out["memory"] = int(pid)
                elif b"executor_service" in argv:
                    out[argv[argv.index(b"--executor-id") + 1].decode()] = int(pid)
                elif b"gateway" in argv:
                    out["gateway"] = int(pid)
        return out

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.config.gateway_port}"

    @property
    def memory(self) -> str:
        return f"127.0.0.1:{self.config.memory_port}"


@pytest.fixture(scope="module")
def up(demo_checkpoint, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up")
    config = StackConfig(metrics_base_port=0).on_free_ports()
    argv = [sys.executable, "-m", "kvpager_tools.cli", "up", "--model", demo_checkpoint,
            "--memory-port", str(config.memory_port), "--gateway-port", str(config.gateway_port),
            "--http-port", str(config.http_port), "--blockmap-port", str(config.blockmap_port),
            "--executor-base-port", str(config.executor_base_port),
            "--metrics-base-port", str(config.metrics_base_port), "--num-blocks", "64", "--swap-blocks", "0",
            "--log-dir", str(log_dir), "--log-level", "WARNING", "--drain-timeout-s", "120",
            "--restart-backoff-s", "0.5"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_") or k == "KVPAGER_HOME"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    running = Up(proc, config, log_dir)
    try:
        running.wait_for(r"Ctrl-C stops the stack")
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(200)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def admin_token(up: Up) -> str:
    return (up.log_dir / "secrets" / "admin_token").read_text().strip()


async def _code(call, *args, **kw) -> grpc.StatusCode:
    try:
        await call(*args, timeout=10, **kw)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        return err.code()


async def _generate(address: str, max_tokens: int, *, on_first=None) -> list[gateway_pb2.GenerateResponse]:
    async with make_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateRequest(prompt="Once upon a time", sampling_params=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        out = []
        async for response in stub.Generate(request, timeout=300):
            out.append(response)
            if on_first is not None and len(out) == 1:
                on_first()
        return out


def _serves(address: str, timeout_s: float = 180) -> list[int]:
    """Retries an 8-token generation until it succeeds; its token ids."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            responses = asyncio.run(_generate(address, 8))
            tokens = [t for r in responses for t in r.token_ids]
            assert len(tokens) == 8 and responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            return tokens
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _metric(up: Up, name: str, child: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{up.config.supervisor_metrics_port}/metrics",
                                  timeout=10).read().decode()
    found = re.search(rf'^{name}\{{child="{child}"\}} (\S+)$', body, re.MULTILINE)
    assert found, body
    return float(found.group(1))


def test_admin_token_is_generated_and_never_on_a_command_line(up):
    path = up.log_dir / "secrets" / "admin_token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = admin_token(up)
    assert len(token) >= 32 and str(path) in up.output() and token not in up.output()
    children = up.children()
    assert set(children) == {"memory", "executor-0", "gateway"}
    for name, pid in children.items():
        assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert f"KVPAGER_ADMIN_TOKEN={token}".encode() in environ, name


def test_mutating_rpcs_refuse_calls_without_the_admin_token(up):
    token = admin_token(up)
    executor = f"127.0.0.1:{up.config.executor_base_port}"

    async def go():
        async with make_channel(up.memory) as mch, make_channel(executor) as ech:
            memory = memory_pb2_grpc.MemoryServiceStub(mch)
            for method, request in MEMORY_MUTATING.items():
                for metadata in (None, auth_metadata("wrong")):
                    got = await _code(getattr(memory, method), request, metadata=metadata)
                    assert got == grpc.StatusCode.UNAUTHENTICATED, (method, metadata)
            stub = executor_pb2_grpc.ExecutorServiceStub(ech)
            for method, request in EXECUTOR_METHODS.items():
                got = await _code(getattr(stub, method), request)
                assert got == grpc.StatusCode.UNAUTHENTICATED, method
            got = await _code(lambda req, **kw: stub.ExecuteStream(req, **kw).read(), executor_pb2.ExecuteRequest())
            assert got == grpc.StatusCode.UNAUTHENTICATED  # the streamed Execute (a decode burst) too
            # Read-only accounting stays open on a loopback stack; the token opens the rest.
            assert await _code(memory.GetAccounting, memory_pb2.AccountingRequest()) == grpc.StatusCode.OK
            assert await _code(memory.ListExecutors, memory_pb2.ListExecutorsRequest()) == grpc.StatusCode.OK
            assert await _code(stub.GetInfo, executor_pb2.GetInfoRequest(),
                               metadata=auth_metadata(token)) == grpc.StatusCode.OK
            snapshot = await memory.GetAccounting(memory_pb2.AccountingRequest(), timeout=10)
            return [e.executor_id for e in snapshot.executors]

    assert asyncio.run(go()) == ["executor-0"]  # the intruder's RegisterExecutor did not land
    _serves(up.gateway)  # and the stack still serves (the Free(abort=True) was refused)


def test_a_killed_executor_is_restarted_and_the_stack_serves_again(up):
    before = _serves(up.gateway)
    old = up.children()["executor-0"]
    os.kill(old, signal.SIGKILL)
    up.wait_for(r"executor-0 exited with code -9; restart 1 in 0\.5s")
    up.wait_for(r"executor-0 restarted \(pid \d+\)")
    assert up.children()["executor-0"] != old
    assert _serves(up.gateway) == before  # greedy: the same tokens from the new process
    assert _metric(up, "kvpager_supervisor_restarts_total", "executor-0") == 1.0
    assert _metric(up, "kvpager_supervisor_restarts_total", "memory") == 0.0
    assert _metric(up, "kvpager_supervisor_child_up", "executor-0") == 1.0
    body = urllib.request.urlopen(f"http://127.0.0.1:{up.config.supervisor_metrics_port}/metrics",
                                  timeout=10).read().decode()
    rss = re.search(r"^process_resident_memory_bytes (\S+)$", body, re.MULTILINE)
    assert rss and float(rss.group(1)) > 1e6, body  # `kvpager up`'s own process
    events = [json.loads(line) for line in (up.log_dir / "supervisor.log").read_text().splitlines()]
    assert [(e["event"], e["child"]) for e in events] == [("child exited", "executor-0"),
                                                         ("child restarted", "executor-0")]
    assert events[0]["exit_code"] == -9 and events[0]["num_restarts"] == 1


def test_a_killed_memory_service_is_restarted_and_the_stack_serves_again(up):
    before = _serves(up.gateway)
    os.kill(up.children()["memory"], signal.SIGKILL)
    up.wait_for(r"memory exited with code -9; restart 1 in 0\.5s")
    up.wait_for(r"memory restarted")
    assert _serves(up.gateway) == before  # executors re-registered, the gateway found them again
    assert _metric(up, "kvpager_supervisor_restarts_total", "memory") == 1.0


def test_sigterm_drains_a_stream_in_flight_then_stops_in_order(up):
    num_tokens = 240  # the demo model's context is 256 tokens
    first = threading.Event()
    result: dict = {}

    def stream() -> None:
        try:
            result["responses"] = asyncio.run(_generate(up.gateway, num_tokens, on_first=first.set))
        except grpc.RpcError as err:
            result["error"] = err
            first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(120) and "error" not in result, f"the stream never started: {result}"
    up.proc.send_signal(signal.SIGTERM)
    assert thread.is_alive(), "the stream ended before the SIGTERM: make it longer"
    up.wait_for(r"stopping: the gateway drains")
    time.sleep(1.0)
    refused = False
    try:  # admission has stopped: a new request is refused while the stream above runs on
        asyncio.run(_generate(up.gateway, 4))
    except grpc.RpcError as err:
        refused = err.code() == grpc.StatusCode.UNAVAILABLE
    thread.join(300)
    assert "error" not in result, result.get("error")
    responses = result["responses"]
    assert sum(len(r.token_ids) for r in responses) == num_tokens
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert refused
    assert up.proc.wait(200) == 0
    up.wait_for(r"stopped: gateway \(0\), executor-0 \(0\), memory \(0\)", timeout_s=30)
