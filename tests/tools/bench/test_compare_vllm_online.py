"""compare-vllm --online's measuring parts on the demo model (vLLM itself is
not installed for tests): both "servers" are one stack's HTTP API, so the
figures are near a ratio of 1, but the rounds, their order, the salts and
the JSON keys are the real ones. Never timed."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvpager_tools.bench import common as bc

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def stack():
    """A stack of its own: in test_bench_smoke the overhead benchmark steps
    the memory service and executor directly, with step ids above the
    gateway's, and from then on the memory service refuses the gateway's
    older ones (the step fence: a single writer), so its requests end 503."""
    opts = bc.StackOptions(model=str(bc.model_dir("demo")), max_running=64, max_batch_tokens=512, num_blocks=256)
    with bc.embedded_stack(opts) as s:
        yield s


def test_online_rounds_alternate_between_servers(stack):
    """compare-vllm --online's round loop (vLLM itself is not installed for
    tests): two labels on the one stack's HTTP API; every round is complete,
    rounds alternate label by label and each waits for a quiet machine."""
    from kvpager_tools.bench.compare_vllm_online import interleaved_rounds

    requests = [bc.BenchRequest(prompt_ids=[5 + i, 6, 7, 8, 9], max_tokens=3) for i in range(3)]
    url = stack.addresses.http
    rounds = interleaved_rounds({"first": url, "second": url}, requests, 2, settle_s=0.05)
    assert list(rounds) == ["first", "second"] and all(len(r) == 2 for r in rounds.values())
    starts = [rounds[label][i]["at_s"] for i in range(2) for label in ("first", "second")]
    assert starts[0] == 0.0 and starts == sorted(starts) and len(set(starts)) == 4
    for r in rounds["first"] + rounds["second"]:
        assert r["output_tokens"] == 9 and r["tok_s"] > 0 and r["ttft_ms"] > 0
        assert r["settled_s"] >= 0.05


def test_single_stream_latency_of_each_server(stack):
    """compare-vllm --online's one-request-at-a-time figures: the median-length
    prompt, each label's latency medians, and the TTFT ratio (both labels on
    the one stack here, so the ratio is near 1 but its keys are real)."""
    from kvpager_tools.bench.compare_vllm_online import interleaved_rounds, single_stream

    prompts = [list(range(5, 5 + n)) for n in (24, 72, 40)]  # whole blocks: a repeat would hit the cache
    url = stack.addresses.http
    servers = {"vllm": url, "kvpager": url}
    # The throughput rounds first, as compare_online runs them: the single
    # stream's prompt is among theirs and must not be served from their blocks.
    interleaved_rounds(servers, [bc.BenchRequest(prompt_ids=p, max_tokens=3) for p in prompts], 2, settle_s=0.05)
    out = single_stream(servers, prompts, 3, 2, settle_s=0.05)
    assert out["prompt_len"] == 40 and out["rounds"] == 2
    for label in ("vllm", "kvpager"):
        assert out[label]["ttft_ms"] > 0 and out[label]["e2e_ms"] >= out[label]["ttft_ms"]
        assert out[label]["tpot_ms"] > 0
        assert out[label]["cached_prompt_tokens"] == 0
    assert out["ttft_ratio_vs_vllm"] == round(out["kvpager"]["ttft_ms"] / out["vllm"]["ttft_ms"], 3)


@pytest.mark.parametrize("argv, message", [
    (["--single-rounds", "3"], "--single-rounds is for the online comparison"),
    (["--online", "--single-rounds", "-1"], "--single-rounds must be >= 0"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--temperature", "-1"], "temperature must be finite and >= 0"),
    (["--temperature", "0.8", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--temperature", "0.8", "--top-k", "-3"], "top_k must be >= 0"),
    (["--top-p", "0.9"], "give a temperature > 0"),
    (["--request-rate", "4"], "--request-rate is for the online comparison"),
    (["--online", "--request-rate", "0"], "--request-rate must be > 0"),
])
def test_compare_vllm_refuses_flags_it_cannot_honour(argv, message):
    """Checked before anything is set up (no vLLM needed)."""
    from kvpager_tools.bench import compare_vllm

    parser = argparse.ArgumentParser()
    compare_vllm.add_bench_parser(parser.add_subparsers())
    args = parser.parse_args(["compare-vllm", "--vllm-python", "/nonexistent/python", *argv])
    with pytest.raises(SystemExit, match=message):
        args.func(args)


def test_sampled_runs_reach_the_engine(stack):
    """compare-vllm --temperature / --top-p / --top-k: the kvpager requests
    carry them over gRPC (the offline comparison's path); the HTTP bodies
    too, and the API takes them. Top-k 1
    samples the greedy token whatever the temperature; a temperature alone
    on the demo model's flat logits leaves greedy's path."""
    from kvpager_tools.bench.compare_hf import kvpager_run
    from kvpager_tools.bench.openai_load import request_body

    prompts = [list(range(5 + i, 25 + i)) for i in range(4)]
    gw = stack.addresses.gateway
    _, greedy = kvpager_run(gw, prompts, 12, "sampling-greedy")
    _, top1 = kvpager_run(gw, prompts, 12, "sampling-top1", sampling=bc.BenchSampling(1.5, 1.0, 1))
    _, hot = kvpager_run(gw, prompts, 12, "sampling-hot", sampling=bc.BenchSampling(1.5, 0.95, 0))
    assert top1 == greedy
    assert hot != greedy and all(len(t) == 12 for t in hot)
    path, body = request_body("openai", "m", [1, 2], 4, ignore_eos=True,
                              sampling=bc.BenchSampling(0.7, 0.9, 40))
    assert path == "/v1/completions" and (body["temperature"], body["top_p"], body["top_k"]) == (0.7, 0.9, 40)
    http = asyncio.run(bc.run_load(bc.Target(backend="openai", base_url=stack.addresses.http),
                                   [bc.BenchRequest(p, 12) for p in prompts], cache_salt="sampling-http-top1",
                                   sampling=bc.BenchSampling(1.5, 1.0, 1)))
    assert all(r.ok and r.num_out == 12 for r in http.records)  # the HTTP client counts tokens, keeps no ids


def test_online_rounds_sample_when_asked(stack):
    """compare-vllm --online --temperature ...: each round's requests sample (the API takes the fields)."""
    from kvpager_tools.bench.compare_vllm_online import interleaved_rounds

    requests = [bc.BenchRequest(prompt_ids=[9 + i, 6, 7, 8, 9], max_tokens=4) for i in range(3)]
    url = stack.addresses.http
    rounds = interleaved_rounds({"a": url}, requests, 1, settle_s=0.05, salt="sampled-",
                                sampling=bc.BenchSampling(0.9, 0.9, 5))
    assert [r["output_tokens"] for r in rounds["a"]] == [12]


def test_online_rounds_at_a_request_rate(stack):
    """compare-vllm --online --request-rate: a round's requests arrive as a
    Poisson process (the same times in every round), so a round lasts at least
    until the last arrival (all at once, every request is in flight at once);
    each round carries the tails (p99 TTFT, TPOT, ITL, E2E) beside the medians."""
    from kvpager_tools.bench.compare_vllm_online import LATENCY_KEYS, _summary, interleaved_rounds

    n, rate = 6, 20.0
    last = bc.arrival_offsets(n, rate, 0)[-1]
    assert last > 0.1  # the spread this test relies on (a fixed seed)
    requests = [bc.BenchRequest(prompt_ids=[11 + i, 6, 7, 8, 9], max_tokens=3) for i in range(n)]
    url = stack.addresses.http
    rounds = interleaved_rounds({"a": url, "b": url}, requests, 1, settle_s=0.05, salt="rate-", rate=rate)
    at_once = interleaved_rounds({"c": url}, requests, 1, settle_s=0.05, salt="rate-once-")
    for r in rounds["a"] + rounds["b"]:
        assert r["output_tokens"] == 3 * n and r["wall_s"] >= last
        # The prefill stall needs a stream running when another's first token comes: this load may have none.
        assert all(r[k] is not None and r[k] > 0 for k in LATENCY_KEYS if k != "prefill_stall_ms")
        assert r["ttft_p99_ms"] >= r["ttft_ms"] and r["e2e_p99_ms"] >= r["e2e_ms"]
    assert at_once["c"][0]["peak_concurrency"] == n
    assert set(_summary(rounds["a"])) - {"prefill_stall_ms"} == {"tok_s", *LATENCY_KEYS} - {"prefill_stall_ms"}
