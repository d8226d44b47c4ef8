"""bad-input: the validation battery, malformed protobufs and garbage bytes on every port.

Three parts:

1. the gateway's validation battery (empty prompts, limits, NaN sampling
   parameters, token ids outside the vocabulary, an oversize message …):
   each gets its exact status code;
2. on every method of every service of every port (gateway, memory service,
   each executor; health and reflection too) raw bytes sent through a
   generic channel: random bytes that do not parse and hand-made malformed
   protobufs (truncated fields, a length past the end, invalid UTF-8 in a
   string, 2,000 nested groups) must be INVALID_ARGUMENT (UNAUTHENTICATED
   where a token is required and missing); the empty message (every field
   at its default) may get any status but UNKNOWN or INTERNAL;
3. afterwards: nothing crashed, nothing leaked, and a greedy request still
   gives its undisturbed output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import grpc
import grpc.aio
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory

from kvpager_tools.drills.common import FORBIDDEN_STATUSES, DrillEnv, DrillResult, greedy_request, random_prompt
from kvpager_tools.drills.runner import Needs
from kvpager.v1 import common_pb2, executor_pb2, gateway_pb2, memory_pb2

NEEDS = Needs(executors=1)


@dataclasses.dataclass
class Options:
    payloads_per_method: int = dataclasses.field(default=16, metadata={
        "help": "random unparsable payloads per method (besides the hand-made ones)"})
    call_timeout_s: float = 5.0


def _services(env: DrillEnv) -> list[tuple[str, str, list, str | None]]:
    """(name, address, method descriptors, token the service requires)."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    sec = env.security
    admin = sec.admin_token if sec else None
    auth = sec.auth_token if sec else None
    extra = [*health_pb2.DESCRIPTOR.services_by_name["Health"].methods,
             *reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"].methods]
    a = env.stack.addresses
    out = [("gateway", a.gateway, [*gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods, *extra], auth),
           ("memory", a.memory, [*memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].methods, *extra], admin)]
    for i, address in enumerate(a.executors):
        out.append((f"executor-{i}", address,
                    [*executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].methods, *extra], admin))
    return out


def _parses(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
        return True
    except Exception:  # noqa: BLE001 - any parse failure
        return False


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _malformed(desc: pb_descriptor.Descriptor) -> list[tuple[str, bytes]]:
    """Hand-made payloads that must not parse as ``desc``."""
    cases = [
        ("truncated varint", b"\x08\xff\xff\xff"),
        ("length past the end", b"\x0a\x05ab"),
        ("4 GiB length", b"\x0a\xff\xff\xff\xff\x0f"),
        ("2000 nested groups", b"\x0b" * 2000),
        ("end group without start", b"\x0c"),
        ("field number 0", b"\x00\x01"),
    ]
    strings = [f for f in desc.fields if f.type == pb_descriptor.FieldDescriptor.TYPE_STRING]
    if strings:
        tag = _varint(strings[0].number << 3 | 2)
        cases.append((f"invalid UTF-8 in {strings[0].name}", tag + b"\x02\xff\xfe"))
    return cases


async def _raw_call(channel, full_method: str, method, payload: bytes, timeout_s: float,
                    token: str | None) -> str:
    """One call with raw bytes as the request; the status name."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        if method.client_streaming:
            call = channel.stream_stream(full_method)(iter([payload]), timeout=timeout_s, metadata=metadata)
        elif method.server_streaming:
            call = channel.unary_stream(full_method)(payload, timeout=timeout_s, metadata=metadata)
        else:
            await channel.unary_unary(full_method)(payload, timeout=timeout_s, metadata=metadata)
            return "OK"
        async for _ in call:  # a stream that answers once is fine: stop reading
            call.cancel()
            return "OK"
        return "OK"
    except grpc.aio.AioRpcError as err:
        return err.code().name


def _battery(info: gateway_pb2.ModelInfo) -> list[tuple[str, gateway_pb2.GenerateRequest, str]]:
    limit, vocab, max_n = info.max_model_len, info.vocab_size, info.max_n or 8

    def req(ids=(5, 6, 7), prompt="", **sp):
        sp.setdefault("max_tokens", 4)
        return gateway_pb2.GenerateRequest(prompt_token_ids=list(ids), prompt=prompt,
                                           sampling_params=common_pb2.SamplingParams(**sp))

    bad = "INVALID_ARGUMENT"
    return [
        ("empty prompt", req(ids=()), bad),
        ("both prompt and ids", req(ids=(5,), prompt="hi"), bad),
        ("prompt at the context limit", req(ids=[5] * limit), bad),
        ("prompt + max_tokens over the limit", req(ids=[5] * (limit - 4), max_tokens=5), bad),
        ("min_tokens over the rest of the context", req(ids=[5] * (limit - 4), max_tokens=0, min_tokens=5), bad),
        ("repetition penalty below 0", req(repetition_penalty=-1.0), bad),
        ("logit bias outside the vocabulary", req(logit_bias={vocab: 1.0}), bad),
        ("negative temperature", req(temperature=-0.5), bad),
        ("nan temperature", req(temperature=math.nan), bad),
        ("inf temperature", req(temperature=math.inf), bad),
        ("top_p above 1", req(top_p=1.5), bad),
        ("nan top_p", req(top_p=math.nan), bad),
        ("top_k below -1", req(top_k=-2), bad),
        ("n above the cap", req(n=max_n + 1), bad),
        ("beam width above the cap", req(beam_width=max_n + 1), bad),
        ("beam search with temperature", req(beam_width=2, temperature=0.5), bad),
        ("n above beam width", req(beam_width=2, n=3), bad),
        ("nan length penalty", req(beam_width=2, length_penalty=math.nan), bad),
        ("token id outside the vocabulary", req(ids=(5, vocab)), bad),
        ("negative token id", req(ids=(5, -4)), bad),
        ("empty stop string", req(stop=["ok", ""]), bad),
        ("stop token outside the vocabulary", req(stop_token_ids=[vocab + 7]), bad),
        ("min_tokens above max_tokens", req(min_tokens=9, max_tokens=4), bad),
        ("oversize message", req(ids=(), prompt="x" * (17 * 2**20)), "RESOURCE_EXHAUSTED"),
    ]


async def run(env: DrillEnv, opts: Options) -> DrillResult:
    result = DrillResult("bad-input")
    c = env.clients
    rng = env.rng
    info = await c.model_info()
    probe = random_prompt(rng, info.vocab_size, 24)
    await env.reference(probe, 16)

    # 1. the validation battery
    battery = {"cases": 0, "wrong_status": 0}
    for name, request, want in _battery(info):
        out = await c.generate(request, timeout_s=opts.call_timeout_s * 4)
        battery["cases"] += 1
        result.record(out.status)
        if out.status != want:
            battery["wrong_status"] += 1
            result.violation(f"battery {name!r}: {out.status} ({out.details}), want {want}")
    result.figures["battery"] = battery

    # 2. garbage on every method of every port
    calls = {"unparsable": 0, "default_message": 0, "methods": 0}
    for service, address, methods, token in _services(env):
        async with c.channel(address) as channel:
            for method in methods:
                calls["methods"] += 1
                full = f"/{method.containing_service.full_name}/{method.name}"
                cls = message_factory.GetMessageClass(method.input_type)
                is_open = not full.startswith("/kvpager.") or (
                    env.security is not None and env.security.open_read_only and service == "memory"
                    and full.rsplit("/", 1)[1] in ("GetAccounting", "WatchAccounting", "ScorePrefix",
                                                     "ListExecutors"))
                payloads = list(_malformed(method.input_type))
                for _ in range(opts.payloads_per_method):
                    for _try in range(50):
                        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 48)))
                        if not _parses(cls, data):
                            payloads.append(("random bytes", data))
                            break
                for label, data in payloads:
                    if _parses(cls, data):
                        continue  # this message type happens to accept it; not garbage for it
                    calls["unparsable"] += 1
                    # Without the token first: auth answers before parsing.
                    if token and not is_open:
                        status = await _raw_call(channel, full, method, data, opts.call_timeout_s, None)
                        result.record(status)
                        if status != "UNAUTHENTICATED":
                            result.violation(f"{service} {full} ({label}) without a token: {status}")
                    status = await _raw_call(channel, full, method, data, opts.call_timeout_s, token)
                    result.record(status)
                    if status != "INVALID_ARGUMENT":
                        result.violation(f"{service} {full} ({label}): {status}, want INVALID_ARGUMENT")
                # The all-defaults message: whatever the answer, never a crash.
                calls["default_message"] += 1
                status = await _raw_call(channel, full, method, b"", opts.call_timeout_s, token)
                result.record(status)
                if status in FORBIDDEN_STATUSES:
                    result.violation(f"{service} {full} (empty message): {status}")
    result.figures["raw_calls"] = calls

    # 3. still serving, and serving the right thing
    out = await c.generate(greedy_request(probe, 16))
    result.record(out.status)
    env.check_output(result, probe, 16, out)
    if out.status != "OK":
        result.violation(f"a plain request after the garbage failed: {out.status} {out.details}")
    await asyncio.sleep(0)
    return result
