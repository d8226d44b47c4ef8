"""CoreBinding: a CPU step's OpenMP team runs bound one thread per core while
it uses every allowed core, is unbound before it shrinks, and is never bound
where the user places threads. The C++ op and the executor are checked in
subprocesses (affinity outlives a test: a bound pytest thread would pass it
to every process started after it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from executor_service.cpu import AFFINITY_ENV, CoreBinding

REPO = Path(__file__).resolve().parents[2]
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


class Recorder:
    """A bind function that records its calls (the policy under test decides when to call it)."""

    def __init__(self, fail: bool = False, raises: bool = False) -> None:
        self.calls: list[tuple[int, tuple[int, ...], bool]] = []
        self.fail, self.raises = fail, raises

    def __call__(self, threads: int, cpus: list[int], spread: bool) -> list[int]:
        self.calls.append((threads, tuple(cpus), spread))
        if self.raises:  # as the op does for a CPU number past CPU_SETSIZE
            raise RuntimeError("bind_team: CPU 5000 out of range")
        return [22 if self.fail and spread else 0] * threads


def on_thread(fn):
    """Run ``fn`` on a fresh thread: ``use`` sets the calling thread's OpenMP thread count."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture(autouse=True)
def no_user_affinity(monkeypatch):
    for key in AFFINITY_ENV:
        monkeypatch.delenv(key, raising=False)


def test_a_team_on_every_core_is_bound_once():
    rec = Recorder()
    binding = CoreBinding((0, 1), True, rec)

    def steps():
        for _ in range(3):
            binding.use(2)
        return binding.bound, torch.get_num_threads()

    assert on_thread(steps) == (True, 2)
    assert rec.calls == [(2, (0, 1), True)]


def test_a_shrinking_team_is_unbound_first_and_bound_again_when_it_grows():
    rec = Recorder()
    binding = CoreBinding((0, 1), True, rec)

    def steps():
        seen = []
        for threads in (2, 1, 1, 2):
            binding.use(threads)
            seen.append((binding.bound, torch.get_num_threads()))
        return seen

    assert on_thread(steps) == [(True, 2), (False, 1), (False, 1), (True, 2)]
    # The unbinding runs on the team still two wide (then it shrinks): both threads are freed.
    assert rec.calls == [(2, (0, 1), True), (2, (0, 1), False), (2, (0, 1), True)]


@pytest.mark.parametrize("case", ["disabled", "one core", "no op", "narrower team", "user env"])
def test_nothing_is_bound_unless_the_team_spans_the_cores_and_nobody_else_places_it(case, monkeypatch):
    rec = Recorder()
    if case == "user env":
        monkeypatch.setenv("OMP_PROC_BIND", "close")
    cores, enabled, bind = {"disabled": ((0, 1), False, rec), "one core": ((0,), True, rec),
                            "no op": ((0, 1), True, None),
                            "narrower team": ((0, 1, 2, 3), True, rec)}.get(case, ((0, 1), True, rec))
    binding = CoreBinding(cores, enabled, bind)
    threads = 1 if case == "one core" else 2

    def step():
        binding.use(threads)
        return binding.bound, torch.get_num_threads()

    assert on_thread(step) == (False, threads)
    assert rec.calls == []


@pytest.mark.parametrize("how", ["errno", "raises"])
def test_a_refused_binding_frees_the_team_and_is_not_tried_again(how):
    rec = Recorder(fail=how == "errno", raises=how == "raises")
    binding = CoreBinding((0, 1), True, rec)

    def steps():
        for threads in (2, 1, 2):
            binding.use(threads)
        return binding.bound, binding.enabled

    assert on_thread(steps) == (False, False)
    assert rec.calls == [(2, (0, 1), True), (2, (0, 1), False)]


def test_the_binding_belongs_to_the_thread_that_made_it():
    rec = Recorder()
    binding = CoreBinding((0, 1), True, rec)
    assert on_thread(lambda: (binding.use(2), binding.bound)[1]) is True
    assert binding.bound is False  # this thread's team was never bound
    assert on_thread(lambda: (binding.use(2), binding.bound)[1]) is True  # another thread: its own team
    assert len(rec.calls) == 2


def run_python(code: str, env: dict | None = None) -> dict:
    full = {**os.environ, **(env or {})}
    for key in AFFINITY_ENV:
        if key not in (env or {}):
            full.pop(key, None)
    full.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kernels_or_skip():
    from kvpager_kernels import cpu_build

    if not cpu_build.available():
        pytest.skip("the C++ CPU kernels are not built here")


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs")
def test_bind_team_binds_each_thread_of_the_callers_team_and_frees_them():
    kernels_or_skip()
    out = run_python("""
        import json, os, threading, torch
        from kvpager_kernels import cpu_build
        assert cpu_build.available()
        cores = sorted(os.sched_getaffinity(0))[:2]
        torch.set_num_threads(2)
        def affinities():
            return {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        errors = list(torch.ops.kvpager_cpu.bind_team(2, cores, True))
        bound = affinities()
        freed_errors = list(torch.ops.kvpager_cpu.bind_team(2, cores, False))
        print(json.dumps({"cores": cores, "me": str(threading.get_native_id()), "errors": errors,
                          "bound": bound, "freed_errors": freed_errors, "freed": affinities()}))
    """)
    cores, me = out["cores"], out["me"]
    assert out["errors"] == [0, 0] and out["freed_errors"] == [0, 0]
    assert out["bound"][me] == [cores[0]]
    workers = [t for t, cpus in out["bound"].items() if cpus == [cores[1]]]
    assert len(workers) == 1  # the team's second thread, on the second core
    assert out["freed"][me] == cores and out["freed"][workers[0]] == cores


EXECUTOR_STEP = """
    import json, os, threading, urllib.request
    import numpy as np
    from executor_service.config import ExecutorConfig
    from executor_service.executor import Executor
    from executor_service.metrics import REG
    from executor_service.step import StepInput
    from executor_service.tables import TableChanges
    from executor_service.cli import add_arguments, config_from_args
    import argparse
    p = argparse.ArgumentParser(); add_arguments(p)
    cfg = config_from_args(p.parse_args(["--model", MODEL, "--num-blocks", "16", "--swap-blocks", "0",
                                         "--executor-id", "bind-test", *FLAGS]))
    ex = Executor(cfg)
    step = StepInput(step_id=1, seq_ids=np.array([7], np.int64), query_lens=np.array([9], np.int32),
                     token_ids=np.arange(3, 12, dtype=np.int32), table_epoch=1,
                     tables=TableChanges(started_seq_ids=np.array([7], np.int64),
                                         started_context_lens=np.zeros(1, np.int32),
                                         started_offsets=np.array([0, 3], np.int32),
                                         started_block_ids=np.arange(3, dtype=np.int32)),
                     context_lens=np.zeros(1, np.int32))
    seen = {}
    def run():  # the service runs steps on a worker thread too
        ex.execute(step)
        seen["step_thread"] = sorted(os.sched_getaffinity(0))
    t = threading.Thread(target=run); t.start(); t.join()
    gauge = REG.get_sample_value("kvpager_executor_step_threads_bound", {"executor_id": "bind-test"})
    print(json.dumps({"cfg": cfg.cpu_bind, "step_thread": seen["step_thread"], "main": sorted(os.sched_getaffinity(0)),
                      "cores": sorted(os.sched_getaffinity(0)), "gauge": gauge}))
"""


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs")
@pytest.mark.parametrize("flags, env, bound", [
    ([], {}, True),
    (["--no-cpu-bind"], {}, False),
    ([], {"OMP_PROC_BIND": "false"}, False),  # the user places (here: declines to place) the threads
])
def test_the_executor_binds_its_step_threads_as_configured(checkpoints, flags, env, bound):
    kernels_or_skip()
    code = f"MODEL = {checkpoints('llama_gqa')!r}\nFLAGS = {flags!r}\n" + textwrap.dedent(EXECUTOR_STEP)
    out = run_python(code, env)
    assert out["cfg"] is ("--no-cpu-bind" not in flags)
    assert out["main"] == out["cores"]  # the thread that built the executor is never touched
    if bound:
        assert out["step_thread"] == out["cores"][:1] and out["gauge"] == 1.0
    else:
        assert out["step_thread"] == out["cores"] and out["gauge"] == 0.0


@pytest.mark.parametrize("text, cores", [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("3,1-2,1", (1, 2, 3)),
                                         (" 2 , 5-6", (2, 5, 6))])
def test_cpu_lists_parse(text, cores):
    from executor_service.cpu import parse_cores

    assert parse_cores(text) == cores


@pytest.mark.parametrize("text", ["", "a", "1-", "-1", "3-1", "1,,2", "0x1", "0-99999999999"])
def test_a_bad_cpu_list_is_refused(text):
    from executor_service.cpu import parse_cores

    with pytest.raises(ValueError):
        parse_cores(text)


def test_the_executor_refuses_cpus_it_may_not_use(tmp_path, checkpoints):
    import argparse

    from executor_service.cli import add_arguments, cpu_cores
    from kvpager.preflight import UsageError

    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad, says in (("1-", "e.g. 0-3"), ("4000", "not among those this process may use"), ("70000", "past 65535")):
        with pytest.raises(UsageError, match="--cpu-cores") as e:
            cpu_cores(p.parse_args(["--model", str(tmp_path), "--cpu-cores", bad]))
        assert says in str(e.value)
    first = min(os.sched_getaffinity(0))
    assert cpu_cores(p.parse_args(["--model", str(tmp_path), "--cpu-cores", str(first)])) == (first,)
    # The whole CLI: exit 2 and one line, before any model loads.
    proc = subprocess.run([sys.executable, "-m", "executor_service", "--model", checkpoints("llama_gqa"),
                           "--cpu-cores", "9999"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--cpu-cores 9999" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(not TWO_CORES, reason="needs two CPUs")
def test_restricting_the_process_reaches_every_thread_now_and_later():
    out = run_python("""
        import json, os, threading, time
        from executor_service.cpu import allowed_cores, restrict_to_cores
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()   # a thread started before
        first = allowed_cores()[0]
        restrict_to_cores((first,))
        seen = {}
        late = threading.Thread(target=lambda: seen.update(late=sorted(os.sched_getaffinity(0)))); late.start(); late.join()
        every = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        stop.set(); early.join()
        print(json.dumps({"first": first, "every": every, "late": seen["late"], "allowed": list(allowed_cores())}))
    """)
    first = out["first"]
    assert len(out["every"]) >= 2 and all(cpus == [first] for cpus in out["every"].values())
    assert out["late"] == [first] and out["allowed"] == [first]


def test_cpu_cores_where_there_is_no_affinity_call_is_a_usage_error(tmp_path, monkeypatch):
    import argparse

    from executor_service.cli import add_arguments, cpu_cores
    from kvpager.preflight import UsageError

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(tmp_path), "--cpu-cores", "0"])
    monkeypatch.delattr(os, "sched_setaffinity")  # as on macOS
    with pytest.raises(UsageError, match="Linux only"):
        cpu_cores(args)
