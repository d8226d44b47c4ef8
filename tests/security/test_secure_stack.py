"""A whole stack with mutual TLS everywhere (certs from scripts/make-dev-ca.sh),
a gateway token, an admin token between services and a prompt limit; logs at
DEBUG. Every service must come up (the executors register over mTLS with the
admin token, the gateway reaches both), refuse what lacks a credential, and
never write a prompt into a log."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import grpc
import pytest

from kvpager.channel import ClientTls, auth_metadata, make_channel
from kvpager_tools.drills import Needs, drill_options, drill_stack, run_drill
from kvpager_tools.drills.common import Clients, greedy_request
from kvpager.packed import pack_i32
from kvpager.v1 import executor_pb2, executor_pb2_grpc, gateway_pb2, memory_pb2, memory_pb2_grpc

S = grpc.StatusCode
MAX_PROMPT_TOKENS = 64
# Nothing like it is in the demo tokenizer's corpus or any log line.
PROMPT_MARKER = "Zanzibar quokka 7391 marmalade"


@pytest.fixture(scope="module")
def env(security_model, dev_certs):
    opts = drill_options(model=security_model, num_blocks=96, block_size=8, swap_blocks=16, max_model_len=256,
                        secure=True, cert_dir=str(dev_certs),
                        gateway_args=f"--max-prompt-tokens {MAX_PROMPT_TOKENS}")
    with drill_stack(Needs(executors=1), opts, log_level="DEBUG") as env:
        yield env


def run(coro):
    return asyncio.run(coro)


def clients(env, **kw) -> Clients:
    sec = env.security
    args = dict(tls=env.stack.client_tls, auth_token=sec.auth_token, admin_token=sec.admin_token)
    args.update(kw)
    return Clients(env.stack.addresses, **args)


async def _generate(env, request=None, **kw):
    c = clients(env, **kw)
    try:
        return await c.generate(request or greedy_request([5, 6, 7, 8], 4), timeout_s=30)
    finally:
        await c.close()


def test_everything_is_tls_with_tokens(env):
    sec = env.security
    assert sec.tls_require_client_auth and sec.auth_token and sec.admin_token
    for child in env.stack.children:
        assert "--tls-cert" in child.argv and "--tls-require-client-auth" in child.argv
        assert sec.admin_token not in " ".join(child.argv) and sec.auth_token not in " ".join(child.argv)
    out = run(_generate(env))
    assert out.status == "OK" and len(out.first) == 4


def test_gateway_refuses_missing_or_wrong_token(env):
    assert run(_generate(env, auth_token=None)).status == "UNAUTHENTICATED"
    assert run(_generate(env, auth_token="wrong")).status == "UNAUTHENTICATED"
    # The admin token is not a client token.
    assert run(_generate(env, auth_token=env.security.admin_token)).status == "UNAUTHENTICATED"


def test_tls_is_required(env, dev_certs):
    async def go(tls):
        async with make_channel(env.stack.addresses.gateway, tls=tls, token=env.security.auth_token) as ch:
            try:
                await ch.unary_unary("/kvpager.v1.Gateway/GetModelInfo")(b"", timeout=5)
                return S.OK
            except grpc.aio.AioRpcError as err:
                return err.code()

    assert run(go(None)) == S.UNAVAILABLE                                   # plaintext
    assert run(go(ClientTls(str(dev_certs / "ca.crt")))) == S.UNAVAILABLE   # TLS without a client cert
    good = ClientTls(str(dev_certs / "ca.crt"), str(dev_certs / "client.crt"), str(dev_certs / "client.key"))
    assert run(go(good)) == S.OK


def test_memory_and_executors_require_the_admin_token(env):
    sec = env.security

    async def go():
        codes = {}
        async with make_channel(env.stack.addresses.memory, tls=env.stack.client_tls) as ch:
            mem = memory_pb2_grpc.MemoryServiceStub(ch)
            for name, call in (("GetAccounting", lambda md: mem.GetAccounting(memory_pb2.AccountingRequest(),
                                                                              metadata=md, timeout=5)),
                               ("Step", lambda md: mem.Step(memory_pb2.StepRequest(), metadata=md, timeout=5)),
                               ("ScorePrefix", lambda md: mem.ScorePrefix(memory_pb2.ScorePrefixRequest(
                                   token_ids=pack_i32([5, 6])), metadata=md, timeout=5))):
                for label, md in (("none", None), ("client token", auth_metadata(sec.auth_token)),
                                  ("admin", auth_metadata(sec.admin_token))):
                    try:
                        await call(md)
                        codes[name, label] = S.OK
                    except grpc.aio.AioRpcError as err:
                        codes[name, label] = err.code()
        async with make_channel(env.stack.addresses.executors[0], tls=env.stack.client_tls) as ch:
            ex = executor_pb2_grpc.ExecutorServiceStub(ch)
            for label, md in (("none", None), ("admin", auth_metadata(sec.admin_token))):
                try:
                    await ex.GetInfo(executor_pb2.GetInfoRequest(), metadata=md, timeout=5)
                    codes["GetInfo", label] = S.OK
                except grpc.aio.AioRpcError as err:
                    codes["GetInfo", label] = err.code()
                try:  # an empty step with the wrong incarnation: refused before anything runs
                    await ex.Execute(executor_pb2.ExecuteRequest(incarnation=1), metadata=md, timeout=5)
                    codes["Execute", label] = S.OK
                except grpc.aio.AioRpcError as err:
                    codes["Execute", label] = err.code()
        return codes

    codes = run(go())
    for method in ("GetAccounting", "Step", "ScorePrefix"):
        assert codes[method, "none"] == codes[method, "client token"] == S.UNAUTHENTICATED, method
        assert codes[method, "admin"] == S.OK, method
    assert codes["GetInfo", "none"] == codes["Execute", "none"] == S.UNAUTHENTICATED
    assert codes["GetInfo", "admin"] == S.OK
    assert codes["Execute", "admin"] == S.FAILED_PRECONDITION


def test_max_prompt_tokens(env):
    ok = run(_generate(env, greedy_request(list(range(3, 3 + MAX_PROMPT_TOKENS)), 2)))
    assert ok.status == "OK"
    over = run(_generate(env, greedy_request(list(range(3, 4 + MAX_PROMPT_TOKENS)), 2)))
    assert over.status == "INVALID_ARGUMENT" and str(MAX_PROMPT_TOKENS) in over.details


def _cli(env, dev_certs, *args, token_env=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_") or k == "KVPAGER_HOME"}
    environ.update(token_env or {})
    tls = ["--tls-ca", str(dev_certs / "ca.crt"), "--tls-client-cert", str(dev_certs / "client.crt"),
           "--tls-client-key", str(dev_certs / "client.key")]
    return subprocess.run([sys.executable, "-m", "kvpager_tools.cli", *args, *tls], capture_output=True, text=True,
                          env=environ, timeout=120)


def test_cli_clients(env, dev_certs):
    a = env.stack.addresses
    sec = env.security
    gen = _cli(env, dev_certs, "generate", "Hello there", "--address", a.gateway, "--max-tokens", "3", "--json",
               token_env={"KVPAGER_AUTH_TOKEN": sec.auth_token})
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout.splitlines()[0])["finish_reason"] == "length"
    denied = _cli(env, dev_certs, "generate", "Hello there", "--address", a.gateway, "--max-tokens", "3")
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    blocks = _cli(env, dev_certs, "blocks", "--address", a.memory, "--json",
                  token_env={"KVPAGER_ADMIN_TOKEN": sec.admin_token})
    assert blocks.returncode == 0, blocks.stderr
    assert json.loads(blocks.stdout)["total_blocks"] == 96
    denied = _cli(env, dev_certs, "blocks", "--address", a.memory, "--json")
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr


def test_bad_input_drill_on_the_secure_stack(env):
    result = run_drill(env, "bad-input", payloads_per_method=2)
    assert result.ok, result.to_dict()
    assert result.failures_by_status["UNAUTHENTICATED"] > 50  # garbage without a token: refused first


def test_logs_never_contain_prompts_or_outputs(env):
    """Last: it reads every log the stack wrote, at DEBUG."""
    async def go():
        c = clients(env)
        try:
            request = gateway_pb2.GenerateRequest(prompt=f"{PROMPT_MARKER} tells a story",
                                                  sampling_params={"max_tokens": 24, "ignore_eos": True})
            ok = [r async for r in c.gateway.Generate(request, timeout=30)]
            # And on error paths: too long, cancelled, unauthenticated.
            long = gateway_pb2.GenerateRequest(prompt=f"{PROMPT_MARKER} " * 40,
                                               sampling_params={"max_tokens": 4})
            assert (await c.generate(long)).status == "INVALID_ARGUMENT"
            assert (await c.generate(request, cancel_after_tokens=2)).status == "CANCELLED"
        finally:
            await c.close()
        bad = clients(env, auth_token="wrong")
        try:
            assert (await bad.generate(request)).status == "UNAUTHENTICATED"
        finally:
            await bad.close()
        return "".join(r.text for r in ok)

    output = run(go())
    assert len(output) >= 8
    logs = "".join(env.stack.log_path(c.name).read_text(errors="replace") for c in env.stack.children)
    assert '"level": "debug"' in logs  # the audit ran at DEBUG
    for secret in ("Zanzibar", "quokka", "marmalade", output.strip()[:24]):
        assert secret not in logs, secret
    for token in (env.security.auth_token, env.security.admin_token):
        assert token not in logs
