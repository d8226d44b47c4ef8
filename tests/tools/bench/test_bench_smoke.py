"""Smoke runs of the gateway benchmarks' core functions on the demo model,
2-4 requests each: the JSON they produce has its keys and sane values.
Never timed: the figures themselves live in docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from kvpager_tools.bench import common as bc

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model() -> str:
    return str(bc.model_dir("demo"))


@pytest.fixture(scope="module")
def stack(model):
    """One stack (metrics on) shared by serve, compare-hf and overhead (which times one-token steps)."""
    opts = bc.StackOptions(model=model, metrics=True, max_running=64, max_batch_tokens=512, num_blocks=256,
                           num_scheduler_steps=1)
    with bc.embedded_stack(opts) as s:
        yield s


def test_datasets_and_stats():
    for name in bc.DATASETS:
        reqs = bc.make_dataset(name, 6, token_lo=3, token_hi=100, input_len=20, output_len=5, range_ratio=0.5,
                               num_prefixes=2, prefix_len=32, suffix_len=4)
        assert len(reqs) == 6 and all(r.prompt_ids and r.max_tokens >= 1 for r in reqs)
        assert all(3 <= t < 100 for r in reqs for t in r.prompt_ids)
    reqs = bc.make_dataset("prefix-repetition", 8, token_lo=3, token_hi=100, num_prefixes=2, prefix_len=32,
                           suffix_len=4)
    # 2 prefixes of 2 blocks, 36-token prompts: 6 of 8 prompts hit 2 blocks each
    assert bc.best_hit_rate(reqs, 16) == pytest.approx(6 * 32 / (8 * 36))
    assert bc.summary_ms([0.001, 0.002, 0.003])["median"] == pytest.approx(2.0)
    assert bc.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert bc.parse_slo(["ttft:100", "tpot:5"]) == {"ttft": 100.0, "tpot": 5.0}
    assert bc.arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_prefill_stalls_are_the_running_streams_gaps_across_a_first_token():
    def rec(chunks_ms: list[float]) -> bc.RequestRecord:
        chunks = [c / 1e3 for c in chunks_ms]
        return bc.RequestRecord(prompt_len=8, max_tokens=len(chunks), start_s=0.0, first_s=chunks[0],
                                end_s=chunks[-1], chunk_s=chunks, num_out=len(chunks))

    running = rec([0, 2, 4, 20, 22])    # a prefill ran alone from 4 to 20 ms
    after = rec([20.1, 22.1, 24])        # its first token, read just after running's token of the same step
    before = rec([19.9, 22.2])           # another, read just before it
    ended = rec([0, 1, 3])               # done before either came
    assert bc.prefill_stalls([running, after, before, ended]) == pytest.approx([0.016, 0.016])
    # Only streams that had begun: those two first tokens came in one step, neither stalls the other.
    assert bc.prefill_stalls([after, before]) == []
    result = bc.LoadResult(records=[running, after], start_s=0.0, end_s=1.0, peak_concurrency=2)
    assert bc.load_metrics(result)["prefill_stall_ms"]["median"] == pytest.approx(16.0)


def test_serve(stack, tmp_path):
    from kvpager_tools.bench.serve import plot, serve

    a = stack.addresses
    args = argparse.Namespace(address=a.gateway, memory_address=a.memory, model="demo", executors=1,
                              num_blocks=None, max_batch_tokens=None, max_running=None, dataset="random",
                              num_prompts=4, input_len=16, output_len=4, range_ratio=0.0, num_prefixes=2,
                              prefix_len=32, suffix_len=4, seed=0, request_rate="inf,50", max_concurrency=None,
                              ignore_eos=True, goodput=["ttft:60000", "e2e:60000"], json=True, plot=None)
    result = serve(args)
    assert [r["request_rate"] for r in result["runs"]] == ["inf", 50.0]
    for r in result["runs"]:
        assert r["completed"] == 4 and r["failed"] == 0 and r["output_tokens"] == 16
        assert r["output_throughput"] > 0 and r["peak_concurrency"] >= 1
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(r[key]) == {"mean", "median", "p90", "p99"}
        assert r["ttft_ms"]["median"] <= r["e2e_ms"]["median"]
        assert r["goodput"]["good_requests"] == 4
        assert {"prefix_hit_rate", "preemptions"} <= set(r["memory"])
        assert "peak_used_fraction" in r["kv_usage"]
    written = plot(result["runs"], str(tmp_path))
    if bc.pyplot() is not None:
        assert any(p.endswith("serve_latency_cdf.png") for p in written)
    for r in result["runs"]:
        r.pop("_records")
    json.dumps(result)


def test_serve_over_http_and_grpc_in_one_run(stack):
    from kvpager_tools.bench.serve import serve

    a = stack.addresses
    args = argparse.Namespace(address=a.gateway, memory_address=a.memory, model="demo", executors=1,
                              num_blocks=None, max_batch_tokens=None, max_running=None, dataset="random",
                              num_prompts=3, input_len=12, output_len=3, range_ratio=0.0, num_prefixes=2,
                              prefix_len=32, suffix_len=4, seed=0, request_rate="inf", max_concurrency=None,
                              ignore_eos=True, goodput=None, json=True, plot=None,
                              backend="grpc,openai,openai-chat", base_url=a.http + "/v1", model_name=None,
                              api_key=None, repeat=1)
    result = serve(args)
    assert [r["backend"] for r in result["runs"]] == ["grpc", "openai", "openai-chat"]
    for r in result["runs"]:
        assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens"] == 9, r.get("errors")
        assert r["ttft_ms"]["median"] > 0 and r["itl_ms"]["median"] is not None
    [row] = result["comparison"]
    assert row["grpc_over_openai_throughput"] > 0 and row["grpc_over_openai-chat_throughput"] > 0
    assert result["machine"]["loadavg"]


def test_serve_samples_when_asked(stack):
    """--temperature / --top-p / --top-k reach every backend's requests; bad values are refused."""
    from kvpager_tools.bench.serve import serve

    a = stack.addresses

    def args(**kw):
        return argparse.Namespace(address=a.gateway, memory_address=None, model="demo", executors=1,
                                  num_blocks=None, max_batch_tokens=None, max_running=None, dataset="random",
                                  num_prompts=3, input_len=12, output_len=5, range_ratio=0.0, num_prefixes=2,
                                  prefix_len=32, suffix_len=4, seed=0, request_rate="inf", max_concurrency=None,
                                  ignore_eos=True, goodput=None, json=True, plot=None, backend="grpc,openai",
                                  base_url=a.http + "/v1", model_name=None, api_key=None, repeat=1, **kw)

    result = serve(args(temperature=0.8, top_p=0.9, top_k=20))
    assert (result["config"]["temperature"], result["config"]["top_p"], result["config"]["top_k"]) == (0.8, 0.9, 20)
    for r in result["runs"]:
        assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens"] == 15, r.get("errors")
    with pytest.raises(SystemExit, match="top_p must be in"):
        serve(args(temperature=0.8, top_p=1.5, top_k=0))


def test_serve_twice_against_one_server_finds_nothing_cached(stack):
    """Two invocations with the same seed send the same prompts to a running
    server (--address): the second must prefill them again, not hit the
    first's blocks (each invocation salts its own)."""
    from kvpager_tools.bench.serve import serve

    a = stack.addresses

    def once() -> dict:
        args = argparse.Namespace(address=a.gateway, memory_address=a.memory, model="demo", executors=1,
                                  num_blocks=None, max_batch_tokens=None, max_running=None, dataset="random",
                                  num_prompts=4, input_len=48, output_len=2, range_ratio=0.0, num_prefixes=2,
                                  prefix_len=32, suffix_len=4, seed=7, request_rate="inf", max_concurrency=None,
                                  ignore_eos=True, goodput=None, json=True, plot=None)
        [run] = serve(args)["runs"]
        assert run["completed"] == 4 and run["input_tokens"] == 4 * 48
        return run

    first, second = once(), once()
    for run in (first, second):
        assert run["cached_prompt_tokens"] == 0 and run["memory"]["prefix_hit_rate"] == 0.0


def test_compare_hf(stack, model):
    from kvpager_tools.bench.compare_hf import compare, make_prompts

    prompts = make_prompts(model, 3, 4, 24, 0)
    result = compare(model, prompts, 4, parity_sample=3, hf_batch_size=3, stack=stack)
    for key in ("kvpager_tok_s", "hf_sequential_tok_s", "hf_static_batch_tok_s", "hf_generate_batch_tok_s",
                "ratio_vs_generate_batch"):
        assert result[key] > 0, key
    assert result["parity"] == {"matched": 3, "total": 3}
    t = result["kvpager_time_s"]
    assert t["steps"] >= 4 and 0 < t["forward"] <= t["wall"]
    json.dumps(result)


def test_contention(stack, model):
    # Before test_overhead: it drives the stack's memory service itself, which fences the stack's gateway.
    from kvpager_tools.bench.contention import measure

    lo, hi = bc.token_range(model)
    request = bc.BenchRequest(prompt_ids=list(range(lo, lo + 20)), max_tokens=4)
    # The same stack over gRPC and over HTTP, the second standing in for vLLM (its ratios computed).
    targets = {"kvpager": bc.Target(address=stack.addresses.gateway),
               "vllm": bc.Target(backend="openai", base_url=stack.addresses.http)}
    out = measure(targets, request, {"quiet": 1, "loaded": 1, "after": 2}, spinners=1)
    for label in targets:
        assert [out[label][p]["requests"] for p in ("quiet", "loaded", "after")] == [1, 1, 2]
        assert all(0 < out[label][p]["ttft_ms"] <= out[label][p]["e2e_ms"] and out[label][p]["tpot_ms"] > 0
                   for p in ("quiet", "loaded", "after"))
        assert len(out[label]["after"]["ttft_ms_each"]) == 2
        assert out[label]["after_first_half_ttft_vs_quiet"] > 0
    assert set(out["ttft_ratio_vs_vllm"]) == set(out["e2e_ratio_vs_vllm"]) == {"quiet", "loaded", "after"}
    assert all(r > 0 for r in [*out["ttft_ratio_vs_vllm"].values(), *out["e2e_ratio_vs_vllm"].values()])
    assert out["after_first_half_ttft_ratio_vs_vllm"] > 0
    json.dumps(out)


def test_overhead(stack, model):
    from kvpager_tools.bench.overhead import measure

    result = measure(model, [2], prompt_len=16, output_len=12, repeats=1, stack=stack, contexts=[64],
                     control_steps=4)  # the sequences end at exactly 64 tokens (the bench checks)
    (cp,) = result["control_plane"]
    assert (cp["batch"], cp["context"], cp["steps"]) == (2, 64, 4)
    assert cp["control_us"] == pytest.approx(cp["step_us"] + cp["execute_overhead_us"], abs=0.5)
    assert cp["control_x_two_echoes"] > 0 and cp["forward_us"] > 0
    assert 0 < cp["bytes_per_step"] == cp["plan_bytes"] <= cp["plan_bytes_max"]
    assert cp["bytes_per_step"] < 200  # two decodes inside their blocks: ids and lengths, no tables
    (row,) = result["batches"]
    assert row["batch"] == 2 and row["echo_us"] > 0 and row["steps_per_window"] >= 1
    assert row["period_us"] >= row["forward_us"] > 0
    assert row["overhead_us"] == pytest.approx(row["period_us"] - row["forward_us"] - row["sample_us"], abs=0.5)
    assert row["overhead_x_echo"] > 0
    json.dumps(result)
    bursting = SimpleNamespace(config=SimpleNamespace(extra_args={"gateway": ["--num-scheduler-steps", "8"]}))
    with pytest.raises(ValueError, match="one-token steps"):
        measure(model, [2], prompt_len=16, output_len=12, repeats=1, stack=bursting)


def test_routing(model):
    from kvpager_tools.bench.routing import compare_routing

    args = argparse.Namespace(model=model, executors=2, num_blocks=64, num_prompts=4, num_prefixes=2,
                              prefix_len=32, suffix_len=4, output_len=2, max_concurrency=1, repeats=1, seed=0)
    result = compare_routing(args)
    assert result["best_hit_rate"] > 0
    for side in ("prefix", "round_robin"):
        assert result[side]["request_throughput"] > 0
        assert 0 <= result[side]["prefix_hit_rate"] <= result["best_hit_rate"] + 1e-9
    # one request at a time: prefix routing finds every cached prefix
    assert result["hit_rate_vs_best"] == pytest.approx(1.0)
    assert result["throughput_ratio"] > 0 and result["ttft_p90_ratio"] > 0
    json.dumps(result)


def test_penalties_bytes_do_not_grow_with_the_context():
    from kvpager_tools.bench.penalties import executor_us, message_bytes

    short, long = message_bytes(8, 64), message_bytes(8, 1024)
    assert short["penalties_bytes"] == long["penalties_bytes"] < 2 * short["plain_bytes"]
    assert long["penalties_history_every_step_bytes"] > 8 * 1024 * 4  # what the executor's histories save
    t = executor_us(4, 64, 320, repeats=2)
    assert t["history_resolve_us"] > 0 and t["sample_penalties_us"] > 0



@pytest.mark.parametrize("name, positions", [("llama-30m-8k", 8192), ("llama-30m-32k", 32768)])
def test_the_long_context_bench_models_are_the_30m_one_with_more_positions(tmp_path, name, positions):
    from transformers import AutoConfig

    from kvpager_tools.demo_model import build_demo_model

    out = build_demo_model(tmp_path / "m", **bc.BENCH_MODELS[name])
    cfg = AutoConfig.from_pretrained(out, local_files_only=True)
    base = bc.BENCH_MODELS["llama-30m"]
    assert cfg.max_position_embeddings == positions
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == \
        (base["hidden_size"], base["num_layers"], base["num_kv_heads"])


def test_the_reference_takes_sdpa_where_eager_scores_would_not_fit(model, monkeypatch):
    # compare-vllm's transformers reference: eager attention materialises
    # [heads, L, L] scores (12.8 GB for one 20,000-token prompt of the 30M
    # model in fp32: the benchmark was killed); past a share of the
    # available memory a prompt goes to SDPA, whose greedy fp32 tokens are
    # eager's here.
    from kvpager_tools.bench import compare_vllm as cv

    assert cv.eager_fits(8, 1000, 4, 1 << 35) and not cv.eager_fits(8, 20_000, 4, 24 << 30)
    assert cv.available_memory() > 1 << 20
    prompts = [[5, 9, 17, 33, 2, 8], [7] * 40]
    eager, used = cv.hf_reference(model, "float32", prompts, 6)
    assert used == {"eager": 2, "sdpa": 0}
    monkeypatch.setattr(cv, "available_memory", lambda: 1 << 10)
    sdpa, used = cv.hf_reference(model, "float32", prompts, 6)
    assert used == {"eager": 0, "sdpa": 2}
    assert sdpa == eager and all(len(o) == 6 for o in sdpa)
