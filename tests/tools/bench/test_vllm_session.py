"""VllmSession ends the vLLM runner and every process it started (a fake
runner stands in for vLLM: it starts a child, as vLLM starts its engine core
and worker, and speaks the runner's JSON-lines protocol)."""

import os
import sys
import time

import pytest

from kvpager_tools.bench import compare_vllm

FAKE_RUNNER = """
import json, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
if "--fail" in open(sys.argv[sys.argv.index("--prompts-json") + 1]).read():
    print(json.dumps({"error": "could not load", "child": child.pid}), flush=True)
    sys.stdin.read()
print(json.dumps({"load_s": 0.1, "child": child.pid}), flush=True)
for line in sys.stdin:
    if line.strip() == "round":
        print(json.dumps({"wall_s": 1.0, "tok_s": 10.0, "load": {}}), flush=True)
"""


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_soon(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_runner(tmp_path, monkeypatch):
    script = tmp_path / "fake_runner.py"
    script.write_text(FAKE_RUNNER)
    monkeypatch.setattr(compare_vllm, "RUNNER", script)
    return script


def _session(prompts):
    return compare_vllm.VllmSession(sys.executable, "model", "float32", prompts, 4, timeout_s=30)


def test_closing_a_session_ends_the_runners_children(fake_runner):
    with _session([[1, 2, 3]]) as s:
        child = s.ready["child"]
        assert _alive(child)
        assert s.round()["tok_s"] == 10.0
        runner = s._proc.pid
    assert _gone_soon(runner)
    assert _gone_soon(child)  # the old close() killed the runner alone: this child lived on


def _sleepers() -> list[int]:
    """The fake runner's children still running, found by their command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"time.sleep(300)" in f.read() and _alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_runner_that_fails_to_load_leaves_nothing_behind(fake_runner):
    before = set(_sleepers())
    with pytest.raises(RuntimeError, match="vLLM run failed: could not load"):
        _session([[1, 2, 3], ["--fail"]])  # raised in __init__: never entered as a context
    deadline = time.monotonic() + 5
    while set(_sleepers()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(_sleepers()) - before


def test_a_group_whose_leader_exited_is_still_ended():
    """The online comparison's server: its API process may exit first and leave its engine behind."""
    import subprocess

    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; "
         "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); print(c.pid, flush=True)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    leader.wait(10)
    assert _alive(child)
    compare_vllm.end_process_group(leader, grace_s=1)
    assert _gone_soon(child)
