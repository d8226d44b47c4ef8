"""`kvpager up` / `kvpager generate`: argument parsing and the exact child
command lines (no processes), the start-up failure path (one cheap child),
and one end-to-end run of the real stack on the demo model."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kvpager_tools.cli import build_parser
from kvpager_tools.stack import Stack, StackConfig, StackError, build_children
from kvpager_tools.stack_config import cpu_executor_cores
from kvpager_tools.up import config_from_args

PY = "PY"  # stands in for sys.executable in the expected command lines


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def children_for(*argv: str, model: str = "/models/m"):
    config = config_from_args(parse("up", *argv))
    config.model, config.python = model, PY
    return build_children(config)


def test_up_two_executors_exact_command_lines():
    children = children_for("--executors", "2", "--redis-url", "redis://cache:6379/0", "--num-blocks", "64",
                            "--swap-blocks", "8", "--metrics-base-port", "9100", "--block-size", "32")
    assert [c.name for c in children] == ["memory", "executor-0", "executor-1", "gateway"]
    slices = cpu_executor_cores(config_from_args(parse("up", "--executors", "2")))  # this machine's cores, halved
    # each child runs its service's own entry point (python -m <service>)
    assert children[0].argv == [PY, "-m", "memory_service", "--host", "127.0.0.1", "--port", "50051",
                                "--metrics-port", "9100", "--http-port", "8001", "--redis-url", "redis://cache:6379/0",
                                "--log-level", "INFO"]
    for i in range(2):
        assert children[1 + i].argv == [
            PY, "-m", "executor_service", "--model", "/models/m", "--executor-id", f"executor-{i}",
            "--host", "127.0.0.1", "--port", str(50060 + i), "--metrics-port", str(9102 + i),
            "--memory-address", "127.0.0.1:50051", "--block-size", "32", "--num-blocks", "64",
            "--swap-blocks", "8", "--dtype", "auto", "--device", "cpu", "--attention-backend", "auto",
            "--model-impl", "auto", *(["--cpu-cores", slices[i]] if slices else []), "--log-level", "INFO"]
    assert children[3].argv == [PY, "-m", "gateway", "--host", "127.0.0.1", "--port", "50050",
                                "--metrics-port", "9101", "--memory-address", "127.0.0.1:50051",
                                "--model", "/models/m", "--http-port", "8000", "--redis-url", "redis://cache:6379/0",
                                "--grace-s", "30", "--log-level", "INFO", "--policy", "priority",
                                "--max-batch-tokens", "2048", "--max-running", "64", "--max-waiting", "1024",
                                "--stream-interval", "1", "--num-scheduler-steps", "8", "--max-burst-ms", "30",
                                "--burst-plan-lead-ms", "6", "--arrival-settle-ms", "3"]
    assert [c.address for c in children] == ["127.0.0.1:50051", "127.0.0.1:50060", "127.0.0.1:50061",
                                             "127.0.0.1:50050"]
    assert [c.metrics_port for c in children] == [9100, 9102, 9103, 9101]


def test_up_defaults_embedded_no_redis_no_metrics_cpu():
    args = parse("up")
    config = config_from_args(args)
    assert (config.model, config.num_executors, config.memory_port, config.gateway_port,
            config.executor_base_port, config.metrics_base_port, config.redis_url, config.device) == (
        None, 1, 50051, 50050, 50060, None, None, "cpu")
    children = children_for()
    flat = [arg for c in children for arg in c.argv]
    assert "--redis-url" not in flat and "--metrics-port" not in flat
    memory = children[0].argv
    assert memory[memory.index("--http-port") + 1] == "8001"  # the block map, on by default
    assert "--http-port" not in children_for("--no-blockmap")[0].argv
    assert "--num-blocks" not in flat and "--kv-cache-gib" not in flat  # the executor sizes its pool
    executor = children[1].argv
    assert executor[executor.index("--device") + 1] == "cpu"


def test_up_passes_every_gateway_scheduling_option():
    from gateway.cli import SCHEDULING_DESTS, add_arguments

    gateway = children_for("--policy", "fcfs", "--max-batch-tokens", "96", "--max-running", "7",
                           "--max-waiting", "33", "--stream-interval", "5", "--num-scheduler-steps", "6",
                           "--max-burst-ms", "12.5", "--no-plan-ahead", "--no-cut-bursts",
                           "--burst-plan-lead-ms", "4.5", "--arrival-settle-ms", "1.5")[-1].argv
    flags = gateway[gateway.index("--policy"):]
    assert flags == ["--policy", "fcfs", "--max-batch-tokens", "96", "--max-running", "7", "--max-waiting", "33",
                     "--stream-interval", "5", "--num-scheduler-steps", "6", "--max-burst-ms", "12.5",
                     "--burst-plan-lead-ms", "4.5", "--arrival-settle-ms", "1.5", "--no-plan-ahead", "--no-cut-bursts"]
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    got = p.parse_args(["--model", "m", *flags])
    assert {d: getattr(got, d) for d in SCHEDULING_DESTS} == dict(
        policy="fcfs", max_batch_tokens=96, max_running=7, max_waiting=33, stream_interval=5, plan_ahead=False,
        num_scheduler_steps=6, max_burst_ms=12.5, cut_bursts=False, burst_plan_lead_ms=4.5, arrival_settle_ms=1.5)
    # every option of the gateway's scheduling group is one `kvpager up` takes
    group = next(g for g in p._action_groups if g.title.startswith("scheduling"))
    assert {a.dest for a in group._group_actions} == set(SCHEDULING_DESTS)


def test_up_pool_size_flags():
    executor = children_for("--kv-cache-gib", "0.25")[1].argv
    assert executor[executor.index("--kv-cache-gib") + 1] == "0.25"
    with pytest.raises(SystemExit):
        parse("up", "--num-blocks", "8", "--kv-cache-gib", "1")
    # --demo shows readable accounting: a small pool unless sized
    assert config_from_args(parse("up", "--demo")).num_blocks == 256
    assert config_from_args(parse("up", "--demo", "--num-blocks", "32")).num_blocks == 32
    assert config_from_args(parse("up", "--demo", "--kv-cache-gib", "1")).num_blocks is None


def test_up_wildcard_host_connects_over_loopback():
    children = children_for("--host", "0.0.0.0")
    assert children[0].address == "127.0.0.1:50051"
    executor = children[1].argv
    assert executor[executor.index("--host") + 1] == "0.0.0.0"
    assert executor[executor.index("--advertise-address") + 1] == "127.0.0.1:50060"
    assert executor[executor.index("--memory-address") + 1] == "127.0.0.1:50051"


def test_extra_args_go_last_per_role():
    config = StackConfig(model="/m", python=PY, extra_args={"gateway": ["--max-running", "8"]})
    children = build_children(config)
    assert children[-1].argv[-2:] == ["--max-running", "8"]
    assert "--max-running" not in children[0].argv
    with pytest.raises(ValueError):
        StackConfig(extra_args={"router": []})
    with pytest.raises(ValueError):
        StackConfig(num_executors=0)


def test_free_ports():
    config = StackConfig(num_executors=3, metrics_base_port=0).on_free_ports()
    ports = [config.memory_port, config.gateway_port, config.http_port, config.blockmap_port,
             *(config.executor_base_port + i for i in range(3)),
             *(config.metrics_base_port + i for i in range(5))]
    assert len(set(ports)) == len(ports) and all(p > 0 for p in ports)
    filled = StackConfig(memory_port=0).with_ports_filled()
    assert filled.memory_port > 0 and (filled.gateway_port, filled.executor_base_port) == (50050, 50060)
    assert filled.http_port == 8000 and StackConfig(http_port=None).on_free_ports().http_port is None


def test_generate_builds_the_request():
    from kvpager_tools.generate import request_from_args

    args = parse("generate", "hello", "--n", "2", "--max-tokens", "8", "--temperature", "0.7", "--top-p", "0.9",
                 "--top-k", "5", "--seed", "3", "--stop", "\n", "--stop", "END", "--ignore-eos",
                 "--priority", "-1", "--cache-salt", "tenant-a")
    req = request_from_args(args)
    p = req.sampling_params
    assert req.prompt == "hello" and req.priority == -1 and req.cache_salt == "tenant-a"
    assert (p.n, p.max_tokens, p.top_k, p.seed, list(p.stop), p.ignore_eos) == (2, 8, 5, 3, ["\n", "END"], True)
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    greedy = request_from_args(parse("generate", "hi")).sampling_params
    assert greedy.temperature == 0 and not greedy.HasField("seed") and greedy.n == 1


def test_generate_grpc_error_prints_code_and_exits_1():
    from kvpager_tools.ports import free_port

    proc = subprocess.run([sys.executable, "-m", "kvpager_tools.cli", "generate", "hi", "--address",
                           f"127.0.0.1:{free_port()}", "--timeout-s", "10"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("UNAVAILABLE: "), proc.stderr


def test_child_dying_during_start_up_stops_the_stack(tmp_path):
    # The memory service refuses an unknown flag and exits 2 at once.
    config = StackConfig(model=str(tmp_path / "no-model"), log_dir=str(tmp_path),
                         extra_args={"memory": ["--no-such-flag"]}).on_free_ports()
    stack = Stack(config)
    with pytest.raises(StackError) as info:
        stack.start()
    err = info.value
    assert err.child == "memory" and "exited with code 2" in err.reason
    assert "--no-such-flag" in err.log_tail and err.log_path == tmp_path / "memory.log"
    assert list(stack.procs) == ["memory"]  # nothing after it was started
    assert all(p.poll() is not None for p in stack.procs.values())


def test_port_in_use_is_refused_before_spawning(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = StackConfig(model="/m", log_dir=str(tmp_path)).on_free_ports()
        config.gateway_port = busy.getsockname()[1]
        stack = Stack(config)
        with pytest.raises(StackError, match="already in use"):
            stack.start()
        assert stack.procs == {}


# --- end to end ----------------------------------------------------------------------


def kvpager(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpager_tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(600)
def test_stack_end_to_end_demo_model(tmp_path, monkeypatch):
    pytest.importorskip("gateway.cli")
    monkeypatch.setenv("KVPAGER_HOME", str(tmp_path / "home"))  # the demo model is built here, once
    stack = Stack(StackConfig(num_executors=1, num_blocks=64, log_dir=str(tmp_path / "logs")).on_free_ports())
    try:
        stack.start()
        a = stack.addresses
        assert (tmp_path / "home" / "models" / "demo" / "config.json").exists()

        gen = kvpager("generate", "Once upon a time", "--address", a.gateway, "--max-tokens", "8",
                      "--temperature", "0", "--ignore-eos", "--json")
        assert gen.returncode == 0, gen.stderr
        (completion,) = [json.loads(line) for line in gen.stdout.splitlines()]
        assert completion["index"] == 0 and completion["finish_reason"] == "length"
        assert len(completion["token_ids"]) == 8 and completion["usage"]["completion_tokens"] == 8
        # the gateway child serves the OpenAI-compatible API on the stack's HTTP port
        import urllib.request

        models = json.loads(urllib.request.urlopen(f"{a.http}/v1/models", timeout=10).read())
        assert models["data"][0]["id"] == "demo" and models["data"][0]["max_model_len"] > 0
        # the memory child serves the block map, and `kvpager up` prints where
        assert "kvpager block map" in urllib.request.urlopen(a.blockmap, timeout=10).read().decode()
        import io

        from rich.console import Console

        from kvpager_tools.up import _print_ready

        out = io.StringIO()
        _print_ready(stack, Console(file=out, width=200))
        assert f"the live block map: {a.blockmap}" in out.getvalue()

        # The finished sequence's blocks go back with the gateway's next step.
        deadline = time.monotonic() + 15
        while True:
            blocks = kvpager("blocks", "--address", a.memory, "--json")
            assert blocks.returncode == 0, blocks.stderr
            data = json.loads(blocks.stdout)
            if data["used_blocks"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert data["used_blocks"] == 0 and data["num_sequences"] == 0
        assert data["total_blocks"] == 64 and [e["executor_id"] for e in data["executors"]] == ["executor-0"]
    finally:
        codes = stack.stop()
    assert set(codes) == {"memory", "executor-0", "gateway"}
    assert all(p.poll() is not None for p in stack.procs.values())
    assert codes == {"memory": 0, "executor-0": 0, "gateway": 0}, codes  # graceful, not killed
    for name in codes:  # JSON logs only: no plain-text banner from any service
        for line in stack.log_path(name).read_text().splitlines():
            assert isinstance(json.loads(line), dict), (name, line)


def test_cpu_executors_split_the_cores(monkeypatch):
    from kvpager_tools.stack import cpu_executor_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = config_from_args(parse("up", "--executors", "4"))
    assert cpu_executor_env(cfg, cores=2) == {"OMP_NUM_THREADS": "1"}
    assert cpu_executor_env(cfg, cores=16) == {"OMP_NUM_THREADS": "4"}
    assert cpu_executor_env(config_from_args(parse("up")), cores=16) == {}  # one executor: all cores
    assert cpu_executor_env(config_from_args(parse("up", "--executors", "2", "--device", "cuda")), cores=16) == {}
    cfg.model, cfg.python = "/models/m", PY
    children = build_children(cfg)
    assert all(("OMP_NUM_THREADS" in c.env) == (c.role == "executor") for c in children)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice wins
    assert cpu_executor_env(cfg, cores=16) == {}


def test_cpu_executors_each_get_their_own_cores(monkeypatch):
    import argparse

    from executor_service.cli import add_arguments as executor_arguments
    from executor_service.cli import cpu_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two, three = (config_from_args(parse("up", "--executors", n)) for n in ("2", "3"))
    assert cpu_executor_cores(two, allowed=(0, 1, 2, 3)) == ["0,1", "2,3"]
    assert cpu_executor_cores(three, allowed=(0, 1, 2, 3)) == ["0", "1", "2"]  # core 3 left to the control plane
    assert cpu_executor_cores(two, allowed=(4, 6, 9)) == ["4", "6"]
    assert cpu_executor_cores(config_from_args(parse("up", "--executors", "4")), allowed=(0, 1)) is None  # too few
    assert cpu_executor_cores(config_from_args(parse("up")), allowed=(0, 1)) is None  # one executor: every core
    assert cpu_executor_cores(config_from_args(parse("up", "--executors", "2", "--device", "cuda")),
                              allowed=(0, 1)) is None
    # The command lines carry this machine's slices, and each executor accepts its own.
    two.model, two.python = "/models/m", PY
    slices = cpu_executor_cores(two)
    for i, child in enumerate(build_children(two)[1:3]):
        p = argparse.ArgumentParser()
        executor_arguments(p)
        args = p.parse_args(child.argv[child.argv.index("-m") + 2:])
        assert args.cpu_cores == (slices[i] if slices else None)
        assert cpu_cores(args) == (tuple(int(c) for c in slices[i].split(",")) if slices else None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's thread count: no slices it would not match
    assert cpu_executor_cores(two, allowed=(0, 1, 2, 3)) is None


def test_up_passes_tenant_and_memory_policy_flags_when_given():
    children = children_for("--tenants", "/etc/kvpager/tenants.json", "--prefix-sharing", "shared",
                            "--preemption-mode", "swap", "--victim-policy", "least-lost-work",
                            "--tenant-max-blocks", "0.5", "--tenant-max-pinned-blocks", "16")
    memory, gateway = children[0].argv, children[-1].argv
    assert gateway[gateway.index("--tenants"):][:4] == ["--tenants", "/etc/kvpager/tenants.json",
                                                         "--prefix-sharing", "shared"]
    assert memory[memory.index("--preemption-mode"):] == [
        "--preemption-mode", "swap", "--victim-policy", "least-lost-work", "--tenant-max-blocks", "0.5",
        "--tenant-max-pinned-blocks", "16.0"]
    # not given: the services' own defaults apply, nothing is passed
    plain = children_for()
    assert "--preemption-mode" not in plain[0].argv and "--tenants" not in plain[-1].argv
    # every forwarded flag is one the service's own parser takes
    import argparse

    from gateway.cli import add_arguments as gateway_arguments
    from memory_service.cli import add_arguments as memory_arguments

    for add, argv in ((memory_arguments, memory), (gateway_arguments, gateway)):
        p = argparse.ArgumentParser()
        add(p)
        p.parse_args(argv[argv.index("-m") + 2:])


def test_up_passes_the_executors_cuda_graph_flags_when_given():
    import argparse

    from executor_service.cli import add_arguments as executor_arguments

    children = children_for("--executors", "2", "--device", "cuda", "--enforce-eager",
                            "--cuda-graph-max-batch", "64")
    for executor in children[1:3]:
        argv = executor.argv
        assert argv[-3:] == ["--enforce-eager", "--cuda-graph-max-batch", "64"]
        p = argparse.ArgumentParser()
        executor_arguments(p)
        parsed = p.parse_args(argv[argv.index("-m") + 2:])
        assert (parsed.enforce_eager, parsed.cuda_graph_max_batch, parsed.device) == (True, 64, "cuda")
    plain = children_for()
    assert not [a for a in plain[1].argv if "eager" in a or "cuda-graph" in a]


@pytest.mark.parametrize("flag, field", [("--no-cpu-bind", "cpu_bind"), ("--no-huge-pages", "huge_pages")])
def test_up_passes_a_cpu_opt_out_to_every_executor(flag, field):
    import argparse

    from executor_service.cli import add_arguments as executor_arguments
    from executor_service.cli import config_from_args

    for given, on in (((flag,), False), ((), True)):
        for executor in children_for("--executors", "2", *given)[1:3]:
            argv = executor.argv
            assert (flag in argv) is not on
            p = argparse.ArgumentParser()
            executor_arguments(p)
            assert getattr(config_from_args(p.parse_args(argv[argv.index("-m") + 2:])), field) is on


def test_up_refuses_a_policy_flag_the_service_would_refuse(capsys):
    with pytest.raises(SystemExit) as e:
        parse("up", "--preemption-mode", "sometimes")
    assert e.value.code == 2 and "--preemption-mode" in capsys.readouterr().err


def test_stack_options_pass_the_decode_burst_settings_on_and_leave_the_defaults_alone():
    from kvpager_tools.stack_config import StackOptions

    assert "gateway" not in StackOptions(model="/m").config().extra_args
    flags = StackOptions(model="/m", num_scheduler_steps=16, max_burst_ms=60_000.0).config().extra_args["gateway"]
    assert flags == ["--num-scheduler-steps", "16", "--max-burst-ms", "60000.0"]
