"""Small versions of the drills that need no Redis, on one 2-executor stack.

The executor-kill drill runs last: it restarts an executor."""

from __future__ import annotations

import asyncio

import pytest
from drill_helpers import assert_ok

from kvpager_tools.drills import Needs, drill_options, drill_stack, run_drill
from kvpager_tools.drills.common import Clients, greedy_request


@pytest.fixture(scope="module")
def env(demo_checkpoint):
    with drill_stack(Needs(executors=2), drill_options(model=demo_checkpoint, num_blocks=192, block_size=8,
                                                      swap_blocks=32, max_model_len=256)) as env:
        yield env


def test_bad_input(env):
    summary = assert_ok(run_drill(env, "bad-input", payloads_per_method=3))
    assert summary["figures"]["battery"]["wrong_status"] == 0
    assert summary["figures"]["raw_calls"]["unparsable"] > 100
    assert summary["failures_by_status"]["INVALID_ARGUMENT"] > 100


def test_cancel(env):
    summary = assert_ok(run_drill(env, "cancel", streams=60, max_tokens=32, mass_abort_streams=12))
    assert summary["figures"]["mass_abort"]["blocks_held"] > 0
    assert summary["figures"]["mass_abort"]["steps_to_release"] <= 2


def test_load(env):
    summary = assert_ok(run_drill(env, "load", streams=50, max_tokens=16, compare_outputs=6))
    assert summary["completions"] + summary["failures_by_status"].get("RESOURCE_EXHAUSTED", 0) == 50
    assert summary["figures"]["outputs_compared"] == 6 and "outputs_not_compared" not in summary["figures"]
    assert env.exact and env.dtype == "float32"  # learned from the executors' GetInfo
    assert summary["figures"]["latency_p99_ms"] > 0
    assert set(summary["figures"]["memory"]) == {"memory", "executor-0", "executor-1", "gateway"}


def test_http_load(env):
    summary = assert_ok(run_drill(env, "http-load", streams=64, max_tokens=8))
    f = summary["figures"]
    assert f["completed"] + f["rejected_429"] == 64 and f["server_errors"] == 0 and f["other_errors"] == 0
    assert f["completed"] > 0 and f["e2e_p99_ms"] > 0


def test_fuzz(env):
    summary = assert_ok(run_drill(env, "fuzz", budget_s=12.0))
    assert summary["figures"]["generate_examples"] > 0 and summary["figures"]["memory_examples"] > 0


def test_soak_reports_each_services_memory(env):
    # two episode kinds on this stack (no Redis): a few episodes, every child's RSS sampled after each
    summary = assert_ok(run_drill(env, "soak", duration_s=6.0, episodes="bad-input,cancel"))
    f = summary["figures"]
    assert f["episodes"] >= 1 and set(f["by_drill"]) <= {"bad-input", "cancel"}
    assert f["outputs_compared"] >= f["episodes"] and "outputs_not_compared" not in f  # fp32: every episode compares
    assert set(f["memory"]) == {"memory", "executor-0", "executor-1", "gateway"}
    for name, m in f["memory"].items():
        assert m["samples"] == f["episodes"] + 1 and m["processes"] == 1, (name, m)
        assert 20 < m["start_mib"] <= m["peak_mib"] < 8192, (name, m)
        assert m["pid"] == env.stack.pid(name)


async def _regressions(env) -> None:
    """Requests that used to fail the whole engine step (INTERNAL for every
    request in flight) are now served or refused on their own."""
    sec = env.security
    c = Clients(env.stack.addresses, tls=env.stack.client_tls)
    try:
        bystander = asyncio.ensure_future(c.generate(greedy_request([5, 6, 7, 8], 24)))
        # A uint64 seed >= 2**63 (or 2**63 - 1 with n = 2) overflowed the int64 seed column.
        huge = await asyncio.gather(*(c.generate(greedy_request([9, 10, 11], 4, seed=s, n=2))
                                      for s in (2**63 - 1, 2**63, 2**64 - 1)))
        assert [o.status for o in huge] == ["OK"] * 3, [o.details for o in huge]
        assert huge[0].tokens == huge[1].tokens  # greedy: the seed does not matter
        # A length penalty of -1e10 made len ** penalty 0.0 and the beam score divided by it.
        out = await c.generate(greedy_request([9, 10, 11], 4, beam_width=2, length_penalty=-1e10))
        assert out.status == "INVALID_ARGUMENT", out.details
        out = await c.generate(greedy_request([9, 10, 11], 4, beam_width=2, length_penalty=-10.0))
        assert out.status == "OK", out.details
        assert (await bystander).status == "OK"
    finally:
        await c.close()
    assert sec is None


def test_requests_that_failed_every_request_in_flight(env):
    asyncio.run(_regressions(env))


def test_abuse(env):
    """Every case of issue 20, small: the right status, the bystander on time
    (3x: this machine is shared; the stalls were 10-20x), no growth, no leak."""
    summary = assert_ok(run_drill(env, "abuse", bystander_tokens=48, score_copies=20_000, prompt_mib=1.0,
                                  stop_strings=100_000, stop_token_ids=200_000, watchers=24, fork_children=20_000,
                                  registers=2, name_mib=0.25, request_id_mib=0.5, repeats=1, max_slowdown=3.0))
    cases = summary["figures"]["cases"]
    assert set(cases) == {"score_prefix", "silent_executor", "huge_prompt", "stop_strings", "stop_token_ids",
                          "watchers", "fork_children", "register_pools", "long_names", "request_id",
                          "foreign_abort"}
    assert cases["foreign_abort"]["status"] == "NOT_FOUND/OK"
    assert all(not c["executor_reaped"] and c["leaked_blocks"] == 0 for c in cases.values())


def test_memory_restart_without_the_mirror(env):
    """A cold restart (no Redis): every in-flight stream completes, token for token."""
    summary = assert_ok(run_drill(env, "memory-restart", streams=6, max_tokens=48, prefix_blocks=2, mirror=False))
    streams = summary["figures"]["streams"]
    assert streams["failed"] == 0 and streams["completed"] == streams["started"] == 6, streams
    assert summary["figures"]["outputs_compared"] >= 6


def test_executor_kill(env):
    summary = assert_ok(run_drill(env, "executor-kill", streams=8, max_tokens=96, after_requests=4))
    figures = summary["figures"]
    assert figures["victim_sequences_at_kill"] >= 1
    assert figures["streams"]["failed"] == 0 and figures["streams"]["completed"] == 8, figures
    assert figures["rejoined_served_prompt_tokens"] > 0
    assert summary["failures_by_status"] == {}
