"""One request cannot stall, bloat or steer the gateway (issue 20): every
limit is checked before the work it bounds, requests belong to their caller,
an executor that never answers GetInfo does not stall the engine loop, and
clients never see internal addresses or sequence ids."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import pytest_asyncio
from gateway_harness import start_stack

from kvpager.v1 import common_pb2, executor_pb2_grpc, gateway_pb2, gateway_pb2_grpc, memory_pb2

pytestmark = pytest.mark.asyncio(loop_scope="module")
S = grpc.StatusCode


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=64, block_size=4, max_prompt_tokens=100)
    yield s
    await s.stop()


def req(ids=(1, 2, 3), prompt="", request_id="", cache_salt="", **sp):
    sp.setdefault("max_tokens", 4)
    return gateway_pb2.GenerateRequest(prompt_token_ids=list(ids), prompt=prompt, request_id=request_id,
                                       cache_salt=cache_salt, sampling_params=common_pb2.SamplingParams(**sp))


async def _refused(stub, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(request, timeout=30):
            pass
    return err.value


CASES = [
    # (name, request, status, the limit the message names)
    ("text prompt over max_prompt_bytes", req(ids=(), prompt="ab " * 40_000), S.INVALID_ARGUMENT,
     "max_prompt_bytes"),
    ("65 stop strings", req(stop=[f"s{i}" for i in range(65)]), S.INVALID_ARGUMENT, "max_stop_strings"),
    ("100k stop strings", req(stop=["x"] * 100_000), S.INVALID_ARGUMENT, "max_stop_strings"),
    ("stop strings over 4096 bytes", req(stop=["é" * 1100, "y" * 2000]), S.INVALID_ARGUMENT, "max_stop_bytes"),
    ("1025 stop token ids", req(stop_token_ids=[1] * 1025), S.INVALID_ARGUMENT, "max_stop_token_ids"),
    ("2M stop token ids", req(stop_token_ids=[1] * 2_000_000), S.INVALID_ARGUMENT, "max_stop_token_ids"),
    ("request id of 129 characters", req(request_id="r" * 129), S.INVALID_ARGUMENT, "max_request_id_chars"),
    ("request id of 4 MiB", req(request_id="r" * 4 * 2**20), S.INVALID_ARGUMENT, "max_request_id_chars"),
    ("request id with a newline", req(request_id="a\nb"), S.INVALID_ARGUMENT, "printable"),
    ("cache salt of 257 bytes", req(cache_salt="s" * 257), S.INVALID_ARGUMENT, "max_cache_salt_bytes"),
]


@pytest.mark.parametrize("name,request_,code,names", CASES, ids=[c[0] for c in CASES])
async def test_limits_are_checked_before_the_work(stack, name, request_, code, names):
    before = await stack.accounting()
    t0 = time.perf_counter()
    err = await _refused(stack.gw, request_)
    assert err.code() == code, err.details()
    assert names in err.details()
    assert time.perf_counter() - t0 < 5.0
    after = await stack.accounting()
    assert after.used_blocks == before.used_blocks and after.num_sequences == before.num_sequences


async def test_limits_at_the_boundary_are_accepted(stack):
    ok = req(request_id="r" * 128, cache_salt="s" * 256, stop=[f"s{i}" for i in range(64)],
             stop_token_ids=list(range(300, 320)) * 51, max_tokens=3)
    outs = [r async for r in stack.gw.Generate(ok, timeout=30)]
    assert outs[-1].finish_reason != 0 and outs[-1].request_id == "r" * 128
    await stack.wait_idle()


async def test_stop_token_ids_are_a_set(stack):
    from gateway.params import Limits, RawParams, validate

    spec = validate(RawParams(max_tokens=4, stop_token_ids=[5, 5, 7]), 3, Limits(64, 320))
    assert spec.stop_token_ids == frozenset({5, 7})


async def test_tokenizing_runs_off_the_event_loop(stack):
    frontend = stack.gateway.frontend
    seen = []
    real = frontend.tokenizer

    class Spy:
        def encode(self, text, add_special_tokens=True):
            seen.append(threading.current_thread() is threading.main_thread())
            return real.encode(text, add_special_tokens=add_special_tokens)

    frontend.tokenizer = Spy()
    try:
        ids = await frontend.encode("hello there")
    finally:
        frontend.tokenizer = real
    assert seen == [False] and ids == list(real.encode("hello there"))


async def _rest(stream) -> list:
    out = []
    while (msg := await stream.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def _two_connections(address: str):
    # A local subchannel pool: each channel is its own connection (grpc shares them by default).
    opts = [("grpc.use_local_subchannel_pool", 1)]
    return grpc.aio.insecure_channel(address, options=opts), grpc.aio.insecure_channel(address, options=opts)


async def test_abort_and_ids_are_scoped_to_the_caller(stack):
    a_ch, b_ch = _two_connections(stack.gateway.address)
    a, b = gateway_pb2_grpc.GatewayStub(a_ch), gateway_pb2_grpc.GatewayStub(b_ch)
    try:
        stream = a.Generate(req(request_id="mine", max_tokens=40, ignore_eos=True), timeout=60)
        first = await stream.read()
        assert first.request_id == "mine"
        # Another connection can neither end it nor learn that the id is in use.
        assert not (await b.Abort(gateway_pb2.AbortRequest(request_id="mine"), timeout=10)).found
        other = [r async for r in b.Generate(req(request_id="mine", max_tokens=2), timeout=30)]
        assert other[-1].finish_reason != 0
        # The owner's own second request with that id does collide.
        err = await _refused(a, req(request_id="mine"))
        assert err.code() == S.ALREADY_EXISTS
        rest = await _rest(stream)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(r.token_ids) for r in [first, *rest]) == 40
        # ... and its owner can abort it.
        stream = a.Generate(req(request_id="mine2", max_tokens=80, ignore_eos=True), timeout=60)
        await stream.read()
        assert (await a.Abort(gateway_pb2.AbortRequest(request_id="mine2"), timeout=10)).found
        rest = await _rest(stream)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    finally:
        await a_ch.close()
        await b_ch.close()
    await stack.wait_idle()


class _SilentExecutor(executor_pb2_grpc.ExecutorServiceServicer):
    """Registered, but its GetInfo never answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetInfo(self, request, context):
        self.calls += 1
        await asyncio.Event().wait()


async def test_an_executor_that_never_answers_does_not_stall_the_loop(stack):
    server = grpc.aio.server()
    silent = _SilentExecutor()
    executor_pb2_grpc.add_ExecutorServiceServicer_to_server(silent, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    t0 = time.perf_counter()
    outs = [r async for r in stack.gw.Generate(req(max_tokens=30, ignore_eos=True), timeout=60)]
    alone = time.perf_counter() - t0  # the same request undisturbed, on this machine now
    info = memory_pb2.ExecutorPoolInfo(executor_id="silent", address=f"127.0.0.1:{port}", num_blocks=8,
                                       block_size=4, model_id="m", incarnation=1)
    await stack.mem.RegisterExecutor(memory_pb2.RegisterExecutorRequest(info=info))
    try:
        await asyncio.sleep(0.5)  # the gateway refreshes every 0.2 s: it has tried to join it
        assert silent.calls >= 1
        t0 = time.perf_counter()
        outs = [r async for r in stack.gw.Generate(req(max_tokens=30, ignore_eos=True), timeout=60)]
        took = time.perf_counter() - t0
        assert sum(len(r.token_ids) for r in outs) == 30
        # Before: each refresh awaited the silent GetInfo (10 s) inside the engine loop: 19.8 s.
        assert took < 2 * alone + 1.0, (took, alone)
        assert "silent" not in stack.gateway.engine.executors
        calls = silent.calls
        await asyncio.sleep(1.0)  # backoff: not asked again at every 0.2 s refresh
        assert silent.calls - calls <= 2
    finally:
        await stack.mem.DeregisterExecutor(memory_pb2.DeregisterExecutorRequest(executor_id="silent"))
        await server.stop(0)
    await stack.wait_idle()


async def test_sequences_freed_behind_the_gateways_back_are_admitted_again(stack, capfd):
    """The memory service forgot the gateway's sequences (freed by another caller):
    the gateway logs why (with the request id), admits them again (recompute) and
    the stream goes on with the tokens of an undisturbed run; the client sees no
    error, no internal address and no sequence id."""
    want = [t for r in [r async for r in stack.gw.Generate(req(max_tokens=60, ignore_eos=True), timeout=60)]
            for t in r.token_ids]
    stream = stack.gw.Generate(req(request_id="victim", max_tokens=60, ignore_eos=True), timeout=60)
    first = await stream.read()
    seq_ids = list(stack.gateway.engine.seqs)
    assert seq_ids
    # Freed behind the gateway's back: its next Step appends to a freed sequence.
    await stack.mem.Free(memory_pb2.FreeRequest(seq_ids=seq_ids))
    got = list(first.token_ids) + [t for r in await _rest(stream) for t in r.token_ids]
    assert got == want
    assert not set(seq_ids) & set(stack.gateway.engine.seqs)  # admitted again under new ids
    captured = capfd.readouterr()
    logged = [line for line in (captured.err + captured.out).splitlines() if "re-admitting" in line]
    assert logged and "victim" in logged[0] and "already freed" in logged[0], logged
    await stack.wait_idle()


async def test_internal_failures_map_to_generic_errors():
    from gateway.failures import EXECUTOR_FAILED, INTERNAL, for_client
    from kvpager.errors import FailedPrecondition, Unavailable

    err = for_client(Unavailable("executor e0 at 127.0.0.1:5: UNAVAILABLE: connection refused"), EXECUTOR_FAILED)
    assert (err.status, err.message, err.retry_after_s) == ("UNAVAILABLE", EXECUTOR_FAILED, 1.0)
    err = for_client(FailedPrecondition("executor e0 at 127.0.0.1:5: table of sequence 7 differs"), EXECUTOR_FAILED)
    assert (err.status, err.message) == ("INTERNAL", INTERNAL)


async def test_a_different_failure_is_not_held_back_behind_a_logged_one(capfd):
    """The failure log is rate-limited per kind, executor and status: a crash
    logged, the same crash again is held back, but a refused step (another
    status) or another executor's loss is logged within the interval."""
    from gateway.failures import FailureLog
    from kvpager.errors import FailedPrecondition, Unavailable

    failures = FailureLog(interval_s=60.0)
    capfd.readouterr()
    failures.ended("executor lost", Unavailable("connection reset"), ["a"], executor_id="e0", status="UNAVAILABLE")
    failures.ended("executor lost", Unavailable("connection reset"), ["b"], executor_id="e0", status="UNAVAILABLE")
    failures.ended("executor lost", FailedPrecondition("step 7 takes its tokens from step 5"), ["c"],
                   executor_id="e0", status="FAILED_PRECONDITION")
    failures.ended("executor lost", Unavailable("connection reset"), ["d"], executor_id="e1", status="UNAVAILABLE")
    captured = capfd.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if "executor lost" in line]
    assert len(lines) == 3, lines
    assert "takes its tokens from step 5" in lines[1] and "e1" in lines[2]
