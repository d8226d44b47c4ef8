"""Observability an operator trusts, on the real in-process stack under load
that preempts (by swap and recompute), shares prefixes and forks: every
service's /metrics is scraped and each family's type checked and the
histograms seen to move (docs/metrics.md), promtool lints the exposition,
the metrics servers answer /health and 404; one log line per finished
request under the client's id (body over header), never prompt text; the
periodic engine stats line."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import grpc
import httpx
import pytest
import pytest_asyncio
from gateway_harness import generate, start_stack
from prometheus_client.parser import text_string_to_metric_families

from kvpager.telemetry import configure_logging
from kvpager.v1 import gateway_pb2
from kvpager_tools.generate import stream_generate

pytestmark = pytest.mark.asyncio(loop_scope="module")

# family (counters without _total) -> type, per service
GATEWAY = {
    "kvpager_num_requests_running": "gauge", "kvpager_num_requests_waiting": "gauge",
    "kvpager_num_requests_swapped": "gauge", "kvpager_prompt_tokens": "counter",
    "kvpager_generation_tokens": "counter", "kvpager_request_success": "counter",
    "kvpager_time_to_first_token_seconds": "histogram", "kvpager_inter_token_latency_seconds": "histogram",
    "kvpager_request_time_per_output_token_seconds": "histogram",
    "kvpager_e2e_request_latency_seconds": "histogram", "kvpager_request_queue_time_seconds": "histogram",
    "kvpager_request_prefill_time_seconds": "histogram", "kvpager_request_decode_time_seconds": "histogram",
    "kvpager_request_prompt_tokens": "histogram", "kvpager_request_generation_tokens": "histogram",
    "kvpager_gateway_requests_in_flight": "gauge", "kvpager_gateway_requests_finished": "counter",
    "kvpager_gateway_step_seconds": "histogram", "kvpager_gateway_http_requests": "counter",
    "kvpager_rpc_requests": "counter", "kvpager_rpc_latency_seconds": "histogram",
}
MEMORY = {
    "kvpager_kv_cache_usage_perc": "gauge", "kvpager_kv_total_blocks": "gauge", "kvpager_kv_free_blocks": "gauge",
    "kvpager_kv_used_blocks": "gauge", "kvpager_kv_cached_evictable_blocks": "gauge",
    "kvpager_kv_live_tokens": "gauge", "kvpager_kv_allocated_slots": "gauge",
    "kvpager_kv_token_occupancy_ratio": "gauge", "kvpager_kv_block_fill_ratio": "gauge",
    "kvpager_kv_pinned_blocks": "gauge",
    "kvpager_kv_contiguous_declared_blocks": "gauge", "kvpager_prefix_cache_recompute_queries": "counter",
    "kvpager_prefix_cache_recompute_hits": "counter", "kvpager_kv_internal_waste_slots": "gauge",
    "kvpager_kv_logical_blocks": "gauge", "kvpager_kv_physical_blocks": "gauge",
    "kvpager_kv_sharing_saved_blocks": "gauge", "kvpager_kv_contiguous_equivalent_blocks": "gauge",
    "kvpager_kv_running_sequences": "gauge", "kvpager_kv_swapped_sequences": "gauge",
    "kvpager_kv_swap_total_blocks": "gauge", "kvpager_kv_swap_free_blocks": "gauge",
    "kvpager_prefix_cache_queries": "counter", "kvpager_prefix_cache_hits": "counter",
    "kvpager_num_preemptions": "counter", "kvpager_kv_copy_on_write_copies": "counter",
    "kvpager_kv_evictions": "counter", "kvpager_kv_swapped_blocks": "counter",
    "kvpager_memory_step_seconds": "histogram", "kvpager_rpc_requests": "counter",
}
EXECUTOR = {
    "kvpager_executor_steps": "counter", "kvpager_executor_tokens_computed": "counter",
    "kvpager_executor_forward_seconds": "histogram", "kvpager_executor_pool_blocks": "gauge",
    "kvpager_executor_step_threads": "counter", "kvpager_executor_forwards": "counter",
    "kvpager_executor_cuda_graphs": "gauge", "kvpager_rpc_requests": "counter",
    "kvpager_executor_bursts_cut": "counter", "kvpager_executor_sub_steps_carried": "counter",
}
MOVED = ("kvpager_time_to_first_token_seconds", "kvpager_inter_token_latency_seconds",
         "kvpager_request_time_per_output_token_seconds", "kvpager_e2e_request_latency_seconds",
         "kvpager_request_queue_time_seconds", "kvpager_request_prompt_tokens", "kvpager_request_generation_tokens")
PROMPT_TEXT = "Observability secret prompt text"
# the process's own families, in every service's registry (as in vLLM's default registry)
PROCESS = {"process_resident_memory_bytes": "gauge", "process_cpu_seconds": "counter",
           "process_start_time_seconds": "gauge", "process_open_fds": "gauge", "python_gc_collections": "counter",
           "python_info": "gauge"}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(model):
    configure_logging("test", "INFO")
    s = await start_stack(model, num_blocks=48, block_size=4, swap_blocks=64, swap_min_tokens=8,
                          preemption_mode="threshold", http={},
                          metrics=True, gateway_kw={"stats_interval_s": 0.2})
    yield s
    await s.stop()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, suffix: str = "", **labels) -> float:
    total = 0.0
    for s in fams[name].samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


async def scrape(port: int, path: str = "/metrics") -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.get(f"http://127.0.0.1:{port}{path}", timeout=10)


async def load(stack) -> None:
    """Concurrent prompts sharing a prefix, long enough to overfill the pool
    (preemption), then one n = 2 (copy-on-write: on its own, so that no
    preemption readmits its children unshared first) and one over HTTP."""
    prefix = list(range(10, 26))
    jobs = [generate(stack.gw, prefix + [40 + i] * 8, max_tokens=20, ignore_eos=True, request_id=f"load-{i}")
            for i in range(10)]
    await asyncio.gather(*jobs)
    await generate(stack.gw, list(range(50, 60)), max_tokens=6, n=2, seed=3, temperature=1.0, request_id="load-fork")
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as http:
        r = await http.post("/v1/completions", json={"prompt": PROMPT_TEXT, "max_tokens": 5},
                            headers={"X-Request-Id": "http-header-id"}, timeout=60)
        assert r.status_code == 200 and r.headers["x-request-id"] == "http-header-id"
        assert r.json()["id"] == "cmpl-http-header-id"


async def test_every_service_exposes_its_families_with_the_right_types_after_load(stack):
    peak = {"running": 0.0}

    async def watch() -> None:
        while True:
            fams = families((await scrape(stack.gateway.runtime.metrics_port)).text)
            peak["running"] = max(peak["running"], value(fams, "kvpager_num_requests_running"))
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    try:
        await load(stack)
    finally:
        watcher.cancel()
    await stack.wait_idle()
    await asyncio.sleep(0.2)  # the queue gauges are recounted when the loop goes idle
    ports = {"gateway": (stack.gateway.runtime.metrics_port, GATEWAY),
             "memory": (stack.memory.runtime.metrics_port, MEMORY),
             "executor": (stack.executors[0].runtime.metrics_port, EXECUTOR)}
    scraped = {}
    for service, (port, expected) in ports.items():
        r = await scrape(port)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        fams = scraped[service] = families(r.text)
        for name, kind in {**expected, **PROCESS}.items():
            assert name in fams, f"{service} lacks {name}"
            assert fams[name].type == kind, f"{service} {name}: {fams[name].type}, not {kind}"
        others = {"gateway": ("kvpager_kv_", "kvpager_executor_"), "memory": ("kvpager_gateway_", "kvpager_executor_"),
                  "executor": ("kvpager_kv_", "kvpager_gateway_")}[service]
        assert not [n for n in fams if n.startswith(others)], f"{service} exposes another service's families"
        assert not [n for n in fams if n.startswith("kvpager_kv_kv")]
        assert await _promtool_check(r.text) == ""
    gw, mem, ex = scraped["gateway"], scraped["memory"], scraped["executor"]
    # the services share this test's process: each shows that process, resident and started before now
    import os
    import time

    with open(f"/proc/{os.getpid()}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    for fams in (gw, mem, ex):
        assert 0.5 * rss < value(fams, "process_resident_memory_bytes") < 2 * rss
        assert value(fams, "process_start_time_seconds") < time.time()
        assert value(fams, "process_cpu_seconds", "_total") > 0
    # On CPU nothing is captured: every forward ran eagerly.
    assert value(ex, "kvpager_executor_cuda_graphs") == 0
    assert value(ex, "kvpager_executor_forwards", "_total", mode="eager") > 0
    assert value(ex, "kvpager_executor_forwards", "_total", mode="graph") == 0
    for name in MOVED:
        assert value(gw, name, "_count") > 0, f"{name} never observed"
    assert value(gw, "kvpager_request_success", "_total", finished_reason="length") >= 11
    assert value(gw, "kvpager_prompt_tokens", "_total") >= 10 * 24 + 10
    assert value(gw, "kvpager_generation_tokens", "_total") >= 10 * 20 + 2 * 6 + 5
    assert peak["running"] > 0
    for name in ("kvpager_num_requests_running", "kvpager_num_requests_waiting", "kvpager_num_requests_swapped"):
        assert value(gw, name) == 0, name
    assert value(mem, "kvpager_prefix_cache_hits", "_total") > 0
    assert value(mem, "kvpager_prefix_cache_queries", "_total") > value(mem, "kvpager_prefix_cache_hits", "_total")
    assert value(mem, "kvpager_num_preemptions", "_total") > 0
    assert value(mem, "kvpager_kv_copy_on_write_copies", "_total") > 0
    assert value(mem, "kvpager_kv_total_blocks", executor="executor-0") == 48
    acc = await stack.accounting()
    assert value(mem, "kvpager_kv_cached_evictable_blocks") == acc.cached_blocks
    assert value(mem, "kvpager_kv_swapped_blocks", "_total", direction="out") == acc.swapped_out_blocks
    assert value(mem, "kvpager_num_preemptions", "_total", mode="swap") == acc.preemptions_swap
    # every family docs/metrics.md names is exposed (the mirror's need Redis: tests/mirror; the
    # supervisor's are `kvpager up`'s own: tests/tools/stack/test_supervisor.py)
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = {n.removesuffix("_total") for n in re.findall(r"`(kvpager_[a-z0-9_]+)", doc)
                  if not n.endswith("_") and not n.startswith(("kvpager_mirror_", "kvpager_supervisor_"))}
    exposed = {name for fams in scraped.values() for name in fams}
    assert documented - exposed == set()
    # the gateway's HTTP /metrics is the same registry as its metrics port
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as http:
        assert "kvpager_time_to_first_token_seconds_bucket" in (await http.get("/metrics")).text


async def _promtool_check(text: str) -> str:
    """promtool's complaints about an exposition ('' = none)."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian's prometheus package; scripts/install.sh --test installs it) is missing")
    proc = await asyncio.to_thread(subprocess.run, ["promtool", "check", "metrics"], input=text.encode(),
                                   capture_output=True, timeout=30)
    return proc.stdout.decode() + proc.stderr.decode()


async def test_metrics_servers_answer_health_and_404(stack):
    for server in (stack.gateway, stack.memory, stack.executors[0]):
        port = server.runtime.metrics_port
        assert (await scrape(port, "/health")).status_code == 200
        for path in ("/", "/metric", "/v1/models"):
            assert (await scrape(port, path)).status_code == 404


def lines_of(err: str) -> list[dict]:
    out = []
    for line in err.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"a log line that is not JSON: {line!r}") from None
    return out


async def test_one_line_per_finished_request_under_the_clients_id(stack, capsys):
    capsys.readouterr()
    # body and header differ: the body wins, in the logs and for Abort
    req = gateway_pb2.GenerateRequest(prompt=PROMPT_TEXT, request_id="body-id",
                                      sampling_params={"max_tokens": 4})
    await stream_generate(stack.gw, req, timeout_s=60, metadata=(("x-request-id", "header-id"),))
    # only the header: it names the request, so Abort finds it by that id
    long = gateway_pb2.GenerateRequest(prompt_token_ids=list(range(30, 60)), sampling_params={
        "max_tokens": 150, "ignore_eos": True})
    task = asyncio.ensure_future(stream_generate(stack.gw, long, timeout_s=60, metadata=(("x-request-id", "only-header"),),
                                                 raise_errors=False))
    for _ in range(200):
        if "only-header" in stack.gateway.engine.requests:
            break
        await asyncio.sleep(0.01)
    assert (await stack.gw.Abort(gateway_pb2.AbortRequest(request_id="only-header"))).found
    await task
    # a failure: a prompt over the context limit
    with pytest.raises(grpc.aio.AioRpcError):
        await stream_generate(stack.gw, gateway_pb2.GenerateRequest(
            prompt_token_ids=[5] * 300, request_id="too-long", sampling_params={"max_tokens": 4}), timeout_s=30)
    await asyncio.sleep(0.3)
    err = capsys.readouterr().err
    logs = lines_of(err)
    assert PROMPT_TEXT not in err
    finished = [r for r in logs if r["event"] in ("request finished", "request failed")]
    by_id = {r["request_id"]: r for r in finished}
    assert len([r for r in finished if r["request_id"] == "body-id"]) == 1
    body = by_id["body-id"]
    assert body["status"] == "ok" and body["finish_reason"] in ("stop", "length")
    assert body["executor_id"] == "executor-0" and body["prompt_tokens"] > 0
    assert body["generated_tokens"] <= 4 and body["e2e_ms"] >= body["ttft_ms"] >= body["queue_time_ms"] >= 0
    assert "cached_tokens" in body and body["num_completions"] == 1
    assert by_id["only-header"]["status"] == "abort" and by_id["only-header"]["finish_reason"] == "abort"
    assert "header-id" not in by_id
    stats = [r for r in logs if r["event"] == "engine stats"]
    assert stats, "no engine stats line"
    for key in ("prompt_throughput_tps", "generation_throughput_tps", "running", "waiting", "swapped",
                "kv_cache_usage_perc", "prefix_hit_rate_perc", "preemptions"):
        assert key in stats[-1], key
    assert any(r["generation_throughput_tps"] > 0 for r in stats)
    # the failed one: logged by the interceptor under the body's id
    assert any(r.get("request_id") == "too-long" for r in logs)


async def test_request_ids_body_wins_over_header_and_bad_ids_are_refused(stack):
    async with httpx.AsyncClient(base_url=stack.gateway.http_url) as http:
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3, "request_id": "chat-body-id"},
                            headers={"X-Request-Id": "chat-header-id"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "chatcmpl-chat-body-id" and r.headers["x-request-id"] == "chat-body-id"
        for bad in ("x" * 129, "caf\u00e9", "a\nb"):
            r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "request_id": bad},
                                timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", bad
        # two prompts in one request: <id>-0, <id>-1
        r = await http.post("/v1/completions", json={"prompt": ["a b", "c d"], "max_tokens": 2},
                            headers={"X-Request-Id": "pair"}, timeout=60)
        assert r.status_code == 200 and r.json()["id"] == "cmpl-pair"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream_generate(stack.gw, gateway_pb2.GenerateRequest(prompt="hi", request_id="y" * 200,
                                                                    sampling_params={"max_tokens": 2}), timeout_s=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    await stack.wait_idle()
