"""The drills that need the Redis mirror, on one 1-executor stack whose
memory service mirrors to a throwaway redis-server."""

from __future__ import annotations

import importlib.util

import pytest
from drill_helpers import assert_ok

from kvpager_tools.drills import Needs, drill_options, drill_stack, run_drill
from kvpager_tools.redis_server import redis_server_binary

pytestmark = [
    pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("memory_service.mirror.recovery") is None,
                       reason="the Redis mirror's restart recovery (memory_service/mirror/recovery.py) is absent"),
]


@pytest.fixture(scope="module")
def env(demo_checkpoint):
    with drill_stack(Needs(executors=1, redis=True), drill_options(model=demo_checkpoint, num_blocks=192, block_size=8,
                                                                  swap_blocks=32, max_model_len=256)) as env:
        yield env


def test_redis_kill(env):
    summary = assert_ok(run_drill(env, "redis-kill", workers=4, max_tokens=16, down_s=2.0))
    figures = summary["figures"]
    assert summary["failures_by_status"] == {}  # serving never fails
    assert figures["stale_after_kill_s"] is not None and figures["resync_after_restart_s"] is not None
    assert figures["redis_keys_after_resync"] > 0


def test_memory_crash_under_load_rebuilds_and_serves_nothing_wrong(env):
    summary = assert_ok(run_drill(env, "memory-restart", streams=6, max_tokens=32, prefix_blocks=4,
                                  kill_signal="KILL", unconfirmed_round=False))
    figures = summary["figures"]
    assert figures["cached_blocks_after_restart"] > 0 and not figures["fenced"]
    assert figures["prefix_hit_after_restart_tokens"] >= 3 * 8
    assert figures["streams"]["failed"] == 0 and figures["streams"]["completed"] == 6, figures


def test_memory_restart(env):
    summary = assert_ok(run_drill(env, "memory-restart", streams=6, max_tokens=64, prefix_blocks=4))
    figures = summary["figures"]
    assert figures["cached_blocks_after_restart"] > 0 and not figures["fenced"]
    assert figures["prefix_hit_after_restart_tokens"] >= 3 * 8
    assert figures["unconfirmed_round"]["prefix_hit_tokens"] == 0
    assert figures["streams"]["failed"] == 0 and figures["streams"]["completed"] == 6, figures


def test_executor_kill_with_one_executor_ends_its_streams_unavailable(env):
    """Nowhere to move them: the bounded UNAVAILABLE of before (this stack has one executor)."""
    summary = assert_ok(run_drill(env, "executor-kill", streams=4, max_tokens=96, after_requests=2, survivor=False))
    figures = summary["figures"]
    assert figures["executors"] == 1 and figures["victim_sequences_at_kill"] >= 1
    assert figures["streams"]["failed"] >= 1 and figures["last_unavailable_after_kill_s"] < 10
    assert set(summary["failures_by_status"]) == {"UNAVAILABLE"}
