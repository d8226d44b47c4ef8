"""The shared gRPC plumbing against real in-process grpc.aio servers.

A throwaway MemoryService servicer raises domain errors; the client must see
the mapped status, details and metadata. No mocks: every check goes over a
socket on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import kvpager
from kvpager import errors
from kvpager.auth import TokenAuth
from kvpager.channel import BoundedCalls, ClientTls, auth_metadata, make_channel, wait_for_serving
from kvpager.server import INTERNAL_DETAILS, ServiceRuntime, TlsConfig
from kvpager.telemetry import configure_logging, registry
from kvpager.v1 import memory_pb2, memory_pb2_grpc

MEMORY = "kvpager.v1.MemoryService"
SECRET = "internal detail: /srv/secret/path"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


class FakeMemory(memory_pb2_grpc.MemoryServiceServicer):
    """Each method exercises one path of the interceptor."""

    PER_STEP_METHODS = ("Free",)  # stands in for Step here: answers its request id in trailing metadata

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def GetAccounting(self, request, context):
        match request.executor_id:
            case "missing":
                raise errors.NotFound("no executor 'missing'")
            case "bad":
                raise errors.InvalidArgument("executor_id is malformed")
            case "full":
                raise errors.ResourceExhausted("pool is full", retry_after_s=0.25)
            case "crash":
                raise RuntimeError(SECRET)
            case "self-abort":
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "aborted by handler")
            case "slow":
                await self.release.wait()
        return memory_pb2.AccountingSnapshot(step_id=7)

    async def WatchAccounting(self, request, context):
        for step_id in range(request.interval_ms):
            yield memory_pb2.AccountingSnapshot(step_id=step_id)
        raise errors.NotFound("watch ended: executor gone")

    async def Free(self, request, context):
        if 0 in request.seq_ids:
            raise errors.InvalidArgument("seq_ids must not hold 0")
        return memory_pb2.FreeResponse(blocks_released=len(request.seq_ids))

    async def ListExecutors(self, request, context):  # writer-style handlers are fine too
        return memory_pb2.ListExecutorsResponse()


@pytest.fixture(autouse=True)
def json_logs():
    configure_logging("plumbing-test", level="INFO")


def memory_runtime(**kwargs) -> tuple[ServiceRuntime, FakeMemory]:
    servicer = FakeMemory()
    runtime = ServiceRuntime("memory-test", grace_s=0.5, **kwargs)
    runtime.add(memory_pb2_grpc.add_MemoryServiceServicer_to_server, servicer, MEMORY)
    return runtime, servicer


@pytest.fixture
async def served():
    runtime, servicer = memory_runtime(metrics_port=0)
    await runtime.start()
    await runtime.set_serving(True)
    channel = make_channel(runtime.address)
    try:
        yield runtime, servicer, memory_pb2_grpc.MemoryServiceStub(channel)
    finally:
        await channel.close()
        await runtime.stop(0)


async def rpc_error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def metadata_value(metadata, key: str) -> str | None:
    return next((v for k, v in (metadata or ()) if k == key), None)


# -- error mapping -------------------------------------------------------------


@pytest.mark.parametrize(
    ("executor_id", "code", "details"),
    [
        ("missing", grpc.StatusCode.NOT_FOUND, "no executor 'missing'"),
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "executor_id is malformed"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "pool is full"),
        ("self-abort", grpc.StatusCode.FAILED_PRECONDITION, "aborted by handler"),
    ],
)
async def test_domain_errors_map_to_status(served, executor_id, code, details):
    _, _, stub = served
    err = await rpc_error(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id=executor_id)))
    assert err.code() == code
    assert err.details() == details


async def test_retry_after_is_trailing_metadata(served):
    _, _, stub = served
    err = await rpc_error(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id="full")))
    assert metadata_value(err.trailing_metadata(), "retry-after-s") == "0.25"
    plain = await rpc_error(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id="missing")))
    assert metadata_value(plain.trailing_metadata(), "retry-after-s") is None


async def test_unexpected_exception_is_internal_without_internals(served, capsys):
    _, _, stub = served
    err = await rpc_error(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id="crash")))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == INTERNAL_DETAILS
    assert "secret" not in (err.debug_error_string() or "")
    # ... but the server logged it, traceback included.
    assert "RuntimeError" in capsys.readouterr().err


async def test_unimplemented_method_stays_unimplemented(served):
    _, _, stub = served
    err = await rpc_error(stub.Step(memory_pb2.StepRequest()))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_streaming_errors_are_mapped_after_messages(served):
    _, _, stub = served
    call = stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=3))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for snapshot in call:
            received.append(snapshot.step_id)
    assert received == [0, 1, 2]
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "watch ended: executor gone"
    assert metadata_value(await call.initial_metadata(), "x-request-id")


async def test_success_passes_through(served):
    _, _, stub = served
    reply = await stub.GetAccounting(memory_pb2.AccountingRequest())
    assert reply.step_id == 7


# -- request ids ----------------------------------------------------------------


async def test_request_id_is_echoed(served):
    _, _, stub = served
    call = stub.GetAccounting(memory_pb2.AccountingRequest(), metadata=(("x-request-id", "req-42"),))
    await call
    assert metadata_value(await call.initial_metadata(), "x-request-id") == "req-42"


async def test_request_id_is_generated_and_survives_errors(served):
    _, _, stub = served
    ids = set()
    for executor_id in ("", "missing"):
        call = stub.GetAccounting(memory_pb2.AccountingRequest(executor_id=executor_id))
        try:
            await call
        except grpc.aio.AioRpcError:
            pass
        request_id = metadata_value(await call.initial_metadata(), "x-request-id")
        assert request_id and len(request_id) == 32
        ids.add(request_id)
    assert len(ids) == 2


async def test_per_step_methods_answer_the_request_id_in_trailing_metadata(served):
    """Called every step: no separate initial-metadata operation; the id comes with the status."""
    runtime, _, stub = served
    assert runtime.per_step_methods == {f"/{MEMORY}/Free"}
    call = stub.Free(memory_pb2.FreeRequest(seq_ids=[3, 4]), metadata=(("x-request-id", "step-3"),))
    assert (await call).blocks_released == 2
    assert metadata_value(await call.trailing_metadata(), "x-request-id") == "step-3"
    assert metadata_value(await call.initial_metadata(), "x-request-id") is None
    generated = stub.Free(memory_pb2.FreeRequest(seq_ids=[5]))
    await generated
    assert len(metadata_value(await generated.trailing_metadata(), "x-request-id")) == 32
    failed = stub.Free(memory_pb2.FreeRequest(seq_ids=[0]), metadata=(("x-request-id", "bad-step"),))
    err = await rpc_error(failed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert metadata_value(err.trailing_metadata(), "x-request-id") == "bad-step"


async def test_request_id_is_in_logs(served, capsys):
    _, _, stub = served
    await rpc_error(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id="crash"), metadata=(("x-request-id", "trace-me"),)))
    assert '"request_id": "trace-me"' in capsys.readouterr().err


# -- health, reflection, metrics -----------------------------------------------


async def health_status(address: str, service: str = "") -> int:
    async with make_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def test_health_flips_with_lifecycle():
    runtime, _ = memory_runtime()
    await runtime.start()
    try:
        assert await health_status(runtime.address) == NOT_SERVING
        assert await health_status(runtime.address, MEMORY) == NOT_SERVING
        with pytest.raises(TimeoutError, match="not SERVING"):
            await wait_for_serving(runtime.address, timeout_s=0.2)
        await runtime.set_serving(True)
        await wait_for_serving(runtime.address, timeout_s=2, service=MEMORY)
        assert await health_status(runtime.address) == SERVING

        # A watcher sees NOT_SERVING as soon as the stop begins, before the server goes.
        async with make_channel(runtime.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=MEMORY))
            assert (await watch.read()).status == SERVING
            stopping = asyncio.create_task(runtime.stop(grace_s=0.3))
            assert (await watch.read()).status == NOT_SERVING
            await stopping
    finally:
        await runtime.stop(0)


async def test_wait_for_serving_times_out_on_nothing_listening():
    with pytest.raises(TimeoutError, match="UNAVAILABLE"):
        await wait_for_serving("127.0.0.1:1", timeout_s=0.3)


async def test_reflection_lists_services(served):
    runtime, _, _ = served
    async with make_channel(runtime.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name async for reply in replies for s in reply.list_services_response.service}
    assert {MEMORY, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def rpc_count(method: str, code: str) -> float:
    labels = {"service": "memory-test", "method": f"/{MEMORY}/{method}", "code": code}
    return registry("memory-test").get_sample_value("kvpager_rpc_requests_total", labels) or 0.0


async def test_metrics_count_every_outcome(served):
    _, _, stub = served
    outcomes = {"": "OK", "missing": "NOT_FOUND", "crash": "INTERNAL", "self-abort": "FAILED_PRECONDITION"}
    before = {code: rpc_count("GetAccounting", code) for code in outcomes.values()}
    for executor_id in outcomes:
        try:
            await stub.GetAccounting(memory_pb2.AccountingRequest(executor_id=executor_id))
        except grpc.aio.AioRpcError:
            pass
    for code in outcomes.values():
        # A status sent by context.abort reaches the client before the server's handler
        # unwinds and counts it: give the count a moment.
        for _ in range(100):
            if rpc_count("GetAccounting", code) == before[code] + 1:
                break
            await asyncio.sleep(0.01)
        assert rpc_count("GetAccounting", code) == before[code] + 1, code
    stream_before = rpc_count("WatchAccounting", "NOT_FOUND")
    with pytest.raises(grpc.aio.AioRpcError):
        async for _ in stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=2)):
            pass
    assert rpc_count("WatchAccounting", "NOT_FOUND") == stream_before + 1
    labels = {"service": "memory-test", "method": f"/{MEMORY}/GetAccounting"}
    assert registry("memory-test").get_sample_value("kvpager_rpc_in_flight", labels) == 0


async def test_metrics_endpoint_serves_text(served):
    runtime, _, stub = served
    await stub.GetAccounting(memory_pb2.AccountingRequest())
    url = f"http://127.0.0.1:{runtime.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    method = f"/{MEMORY}/GetAccounting"
    assert f'kvpager_rpc_requests_total{{code="OK",method="{method}",service="memory-test"}}' in text
    assert f'kvpager_rpc_latency_seconds_count{{method="{method}",service="memory-test"}}' in text
    assert "kvpager_rpc_in_flight" in text


def _get(url: str) -> tuple[int, str]:
    import urllib.error

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_metrics_server_health_follows_serving_and_unknown_paths_are_404():
    runtime, _ = memory_runtime()
    runtime.metrics_port = 0
    await runtime.start()
    try:
        base = f"http://127.0.0.1:{runtime.metrics_port}"
        assert (await asyncio.to_thread(_get, base + "/health"))[0] == 503  # NOT_SERVING until ready
        await runtime.set_serving(True)
        assert await asyncio.to_thread(_get, base + "/health") == (200, "ok\n")
        for path in ("/", "/metricsx", "/v1/models", "/health/x"):
            status, body = await asyncio.to_thread(_get, base + path)
            assert status == 404 and "/metrics" in body, path
        # only this service's registry: no other service's families
        status, text = await asyncio.to_thread(_get, base + "/metrics")
        assert status == 200 and "kvpager_gateway_" not in text and "kvpager_executor_" not in text
    finally:
        await runtime.stop(0)


# -- lifecycle -------------------------------------------------------------------


async def test_graceful_stop_lets_in_flight_calls_finish():
    runtime, servicer = memory_runtime()
    await runtime.start()
    async with make_channel(runtime.address) as channel:
        stub = memory_pb2_grpc.MemoryServiceStub(channel)
        slow = asyncio.ensure_future(stub.GetAccounting(memory_pb2.AccountingRequest(executor_id="slow")))
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(runtime.stop(grace_s=5))
        await asyncio.sleep(0.1)
        servicer.release.set()
        assert (await slow).step_id == 7
        await stopping


async def test_port_cannot_be_shared():
    first, _ = memory_runtime()
    port = await first.start()
    try:
        second, _ = memory_runtime(port=port)
        with pytest.raises(OSError, match="cannot bind"):
            await second.start()
    finally:
        await first.stop(0)


def test_sigterm_stops_gracefully():
    script = textwrap.dedent(
        """
        import asyncio, sys
        from kvpager.server import ServiceRuntime
        from kvpager.telemetry import configure_logging

        async def main():
            configure_logging("sig-test")
            runtime = ServiceRuntime("sig-test", grace_s=1.0)
            await runtime.start()
            await runtime.set_serving(True)
            print(runtime.port, flush=True)
            await runtime.serve_until_signal()

        asyncio.run(main())
        """
    )
    repo_root = pathlib.Path(kvpager.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        port = int(proc.stdout.readline())
        asyncio.run(wait_for_serving(f"127.0.0.1:{port}", timeout_s=5))
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 5
        assert "server stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- auth and TLS -----------------------------------------------------------------


async def test_token_auth():
    open_method = "/kvpager.v1.MemoryService/ListExecutors"
    runtime, _ = memory_runtime(auth=TokenAuth("s3cret", open_methods=frozenset({open_method})))
    await runtime.start()
    await runtime.set_serving(True)
    try:
        async with make_channel(runtime.address) as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            for metadata in ((), auth_metadata("wrong"), (("authorization", "s3cret"),)):
                err = await rpc_error(stub.GetAccounting(memory_pb2.AccountingRequest(), metadata=metadata))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            streamed = stub.WatchAccounting(memory_pb2.WatchAccountingRequest(interval_ms=1))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in streamed:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

            ok = await stub.GetAccounting(memory_pb2.AccountingRequest(), metadata=auth_metadata("s3cret"))
            assert ok.step_id == 7
            await stub.ListExecutors(memory_pb2.ListExecutorsRequest())  # open method
            await wait_for_serving(runtime.address, timeout_s=2)  # health is always open

        async with make_channel(runtime.address, token="s3cret") as channel:  # the interceptor form
            assert (await memory_pb2_grpc.MemoryServiceStub(channel).GetAccounting(memory_pb2.AccountingRequest())).step_id == 7
    finally:
        await runtime.stop(0)


def _write_certs(tmp_path):
    """A CA, a server cert for 127.0.0.1/localhost and a client cert, as PEM files."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(name, issuer_name, issuer_key, *, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return key, cert

    def save(stem, key, cert):
        (tmp_path / f"{stem}.key").write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        (tmp_path / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(tmp_path / f"{stem}.crt"), str(tmp_path / f"{stem}.key")

    ca_key, ca_cert = issue("kvpager-test-ca", "kvpager-test-ca", None, ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = save("server", *issue("localhost", "kvpager-test-ca", ca_key, san=san))
    client = save("client", *issue("client", "kvpager-test-ca", ca_key))
    ca_file, _ = save("ca", ca_key, ca_cert)
    return ca_file, server, client


async def test_mutual_tls(tmp_path):
    ca_file, (server_crt, server_key), (client_crt, client_key) = _write_certs(tmp_path)
    tls = TlsConfig(server_crt, server_key, ca_file=ca_file, require_client_auth=True)
    runtime, _ = memory_runtime(tls=tls)
    await runtime.start()
    try:
        good = ClientTls(ca_file, client_crt, client_key)
        async with make_channel(runtime.address, tls=good) as channel:
            reply = await memory_pb2_grpc.MemoryServiceStub(channel).GetAccounting(memory_pb2.AccountingRequest())
            assert reply.step_id == 7
        async with make_channel(runtime.address, tls=ClientTls(ca_file)) as channel:  # no client cert
            err = await rpc_error(
                memory_pb2_grpc.MemoryServiceStub(channel).GetAccounting(memory_pb2.AccountingRequest(), timeout=2)
            )
            assert err.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await runtime.stop(0)


# -- client helpers ------------------------------------------------------------------


async def test_bounded_calls_bounds_concurrency(served):
    _, _, stub = served
    bound = BoundedCalls(2)
    peak = 0

    async def one():
        nonlocal peak
        async with bound:
            peak = max(peak, bound.num_in_flight)
            await stub.GetAccounting(memory_pb2.AccountingRequest())

    await asyncio.gather(*(one() for _ in range(8)))
    assert peak == 2
    assert bound.num_in_flight == 0


async def test_sync_channel(served):
    runtime, _, _ = served

    def call():
        with make_channel(runtime.address, aio=False) as channel:
            return memory_pb2_grpc.MemoryServiceStub(channel).GetAccounting(memory_pb2.AccountingRequest(), timeout=5)

    assert (await asyncio.to_thread(call)).step_id == 7



# -- telemetry -------------------------------------------------------------------------


def test_configure_logging_is_idempotent(capsys):
    configure_logging("first")
    configure_logging("second")
    capsys.readouterr()
    logging.getLogger("some.library").warning("once")
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["event"] == "once" and record["service"] == "second" and record["level"] == "warning"
    assert "timestamp" in record


def test_log_format_console_renders_readable_lines_and_json_is_the_default(capsys):
    from kvpager.telemetry import get_logger

    try:
        configure_logging("svc", log_format="console")
        capsys.readouterr()
        get_logger("t").info("request finished", request_id="r-1", e2e_ms=12.5)
        line = capsys.readouterr().err.strip()
        assert "request finished" in line and "request_id=r-1" in line and not line.startswith("{")
        with pytest.raises(ValueError, match="log format"):
            configure_logging("svc", log_format="xml")
    finally:
        configure_logging("svc")
    capsys.readouterr()
    get_logger("t").info("hello")
    assert json.loads(capsys.readouterr().err)["event"] == "hello"


def test_service_flags_for_logs_and_metrics():
    import argparse

    from gateway.cli import add_arguments as gateway_args, config_from_args as gateway_config
    from memory_service.cli import add_arguments as memory_args, config_from_args as memory_config

    p = argparse.ArgumentParser()
    memory_args(p)
    cfg = memory_config(p.parse_args(["--metrics-port", "9101", "--metrics-host", "0.0.0.0", "--http-port", "8001"]))
    assert (cfg.metrics_port, cfg.metrics_host, cfg.http_port, cfg.http_host) == (9101, "0.0.0.0", 8001, "127.0.0.1")
    with pytest.raises(SystemExit):
        p.parse_args(["--log-format", "xml"])
    g = argparse.ArgumentParser()
    gateway_args(g)
    gcfg = gateway_config(g.parse_args(["--model", "/m", "--metrics-host", "::", "--stats-interval-s", "2"]))
    assert gcfg.metrics_host == "::" and gcfg.stats_interval_s == 2
    with pytest.raises(ValueError, match="stats-interval-s"):
        gateway_config(g.parse_args(["--model", "/m", "--stats-interval-s", "-1"]))
