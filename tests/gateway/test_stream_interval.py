"""stream_interval: a completion's first token is streamed at once (as
vLLM's), then deltas of that many (its last delta carries the rest), or it
goes once, when it ends, if the interval covers max_tokens; the tokens, text,
logprobs and usage a client assembles are the same as streamed every step.
The gateway's --stream-interval is the default; a request's value wins."""

from __future__ import annotations

import pytest
import pytest_asyncio
from gateway_harness import params, start_stack

from gateway.params import FINAL_ONLY, Limits, RawParams, validate
from kvpager.errors import InvalidArgument
from kvpager.v1 import common_pb2, gateway_pb2
from kvpager_tools.generate import stream_generate

asyncio_module = pytest.mark.asyncio(loop_scope="module")

PROMPT = [17, 30, 44, 30, 91, 17, 120, 5, 66, 200, 30, 14, 8]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    s = await start_stack(model, num_blocks=96, block_size=4, stream_interval=3)  # the gateway's default: 3
    yield s
    await s.stop()


async def _run(stack, interval: int, **kw):
    """-> (the responses of one Generate, the Stream the helper assembled)."""
    responses = []
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, stream_interval=interval,
                                      sampling_params=params(**kw))
    out = await stream_generate(stack.gw, req, timeout_s=60, on_chunk=lambda resp, _: responses.append(resp))
    return responses, out


def _sizes(responses, index=0):
    return [len(r.token_ids) for r in responses if r.index == index]


@asyncio_module
async def test_deltas_of_the_interval_assemble_what_every_step_streams(stack):
    kw = dict(max_tokens=10, ignore_eos=True, logprobs=1, top_logprobs=2)
    every, want = await _run(stack, 1, **kw)
    fours, got = await _run(stack, 4, **kw)
    assert _sizes(every) == [1] * 10
    assert _sizes(fours) == [1, 4, 4, 1]  # the first token at once; the last delta carries the rest
    assert [r.finish_reason for r in fours] == [0, 0, 0, common_pb2.FINISH_REASON_LENGTH]
    (w,), (g,) = want.ordered, got.ordered
    assert g.token_ids == w.token_ids and g.text == w.text
    assert g.usage["completion_tokens"] == w.usage["completion_tokens"] == 10  # (the second hit the prefix cache)
    assert g.logprobs == pytest.approx(w.logprobs)
    assert [len(r.top_logprobs) for r in fours] == [1, 4, 4, 1]  # per token, as the tokens
    await stack.wait_idle()


@asyncio_module
async def test_an_interval_past_max_tokens_sends_each_completion_once(stack):
    kw = dict(max_tokens=7, ignore_eos=True, n=2, temperature=0.8, seed=7)
    every, want = await _run(stack, 1, **kw)
    once, got = await _run(stack, 2**32 - 1, **kw)
    assert sorted(r.index for r in once) == [0, 1] and _sizes(once, 0) == [7] and _sizes(once, 1) == [7]
    assert all(r.finish_reason == common_pb2.FINISH_REASON_LENGTH and r.usage.completion_tokens == 7 for r in once)
    assert got.tokens == want.tokens
    await stack.wait_idle()


@asyncio_module
async def test_a_stop_before_the_interval_ends_the_completion_with_what_it_has(stack):
    eos = min(stack.gateway.engine.eos_ids)
    # min_tokens masks EOS for 2 tokens; the bias then makes it the third: 3 tokens, the interval is 8
    responses, out = await _run(stack, 8, max_tokens=20, min_tokens=2, logit_bias={eos: 100.0})
    assert _sizes(responses) == [1, 2] and responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert out.ordered[0].token_ids[-1] == eos
    await stack.wait_idle()


@asyncio_module
async def test_the_gateway_default_applies_when_a_request_sets_none(stack):
    default, _ = await _run(stack, 0, max_tokens=8, ignore_eos=True)  # the stack's --stream-interval 3
    assert _sizes(default) == [1, 3, 3, 1]
    await stack.wait_idle()


@asyncio_module
async def test_a_client_leaving_between_deltas_releases_everything(stack):
    """The client cancels after its second delta (tokens still held for the next one): the
    request ends and every block is freed; the next request is served."""
    req = gateway_pb2.GenerateRequest(prompt_token_ids=PROMPT, stream_interval=2,
                                      sampling_params=params(max_tokens=40, ignore_eos=True))
    out = await stream_generate(stack.gw, req, timeout_s=60, cancel_after_tokens=2)
    assert out.status == "CANCELLED" and len(out.ordered[0].token_ids) == 3  # deltas of 1, then 2
    await stack.wait_idle()
    after, _ = await _run(stack, 2, max_tokens=4, ignore_eos=True)
    assert _sizes(after) == [1, 2, 1]
    await stack.wait_idle()


def test_validation_bounds_the_interval_by_max_tokens():
    limits = Limits(max_model_len=64, vocab_size=100, stream_interval=5)
    assert validate(RawParams(max_tokens=10), 4, limits).stream_interval == 5
    assert validate(RawParams(max_tokens=10, stream_interval=2), 4, limits).stream_interval == 2
    assert validate(RawParams(max_tokens=10, stream_interval=FINAL_ONLY), 4, limits).stream_interval == 10
    assert validate(RawParams(max_tokens=3), 4, limits).stream_interval == 3
    with pytest.raises(InvalidArgument, match="stream_interval must be >= 1") as err:
        validate(RawParams(max_tokens=10, stream_interval=-1), 4, limits)
    assert err.value.param == "stream_interval"


def test_the_gateway_flag_is_checked_and_passed_on_by_kvpager_up():
    import argparse

    from gateway.cli import add_scheduling_arguments, scheduling_argv

    p = argparse.ArgumentParser()
    add_scheduling_arguments(p)
    args = p.parse_args(["--stream-interval", "16"])
    argv = scheduling_argv(args)
    assert argv[argv.index("--stream-interval") + 1] == "16"
    assert p.parse_args(argv).stream_interval == 16
    assert p.parse_args([]).stream_interval == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--stream-interval", "0"])
