"""The step order: priority is honoured by default, and where no request sets
one the default order is exactly FCFS (running first, then arrival)."""

from __future__ import annotations

import itertools

import pytest

from gateway.cli import add_arguments, config_from_args
from gateway.params import SamplingSpec
from gateway.scheduling import DEFAULT_POLICY, FcfsPolicy, PriorityPolicy, Scheduler, make_policy
from gateway.state import Request, Seq
from kvpager.seq_status import SeqStatus

_ids = itertools.count()


def seq(arrival: int, status: SeqStatus = SeqStatus.WAITING, priority: int = 0, num_tokens: int = 8) -> Seq:
    req = Request(f"r{arrival}", [1] * num_tokens, SamplingSpec(max_tokens=4), 0, priority=priority, arrival=arrival)
    s = Seq(next(_ids), req, None, [1] * num_tokens, "e", status=status)
    if status is SeqStatus.RUNNING:
        s.num_computed = num_tokens - 1
    return s


def order(policy, seqs) -> list[int]:
    batch = Scheduler(policy, max_batch_tokens=10**6, max_running=100).schedule(seqs, {"e"})
    return [s.request.arrival for s in batch.seqs]


def test_the_default_is_priority():
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    config = config_from_args(p.parse_args(["--model", "m"]))
    assert DEFAULT_POLICY == "priority" and config.engine.policy == "priority"
    assert isinstance(make_policy(config.engine.policy), PriorityPolicy)


def test_equal_priorities_schedule_exactly_as_fcfs():
    # a preempted (waiting again) early arrival, running later ones, new waiting ones
    seqs = [seq(5), seq(0), seq(3, SeqStatus.RUNNING), seq(1, SeqStatus.RUNNING), seq(4), seq(2, SeqStatus.SWAPPED)]
    assert order(PriorityPolicy(), seqs) == order(FcfsPolicy(), seqs) == [1, 2, 3, 0, 4, 5]


def test_a_more_important_request_goes_first_even_behind_many():
    queued = [seq(i) for i in range(200)] + [seq(200, SeqStatus.RUNNING)]
    urgent = seq(201, priority=-5)
    assert order(PriorityPolicy(), [*queued, urgent])[0] == 201
    assert order(FcfsPolicy(), [*queued, urgent])[0] == 200  # fcfs: priority ignored
    # and a less important running one comes after a more important waiting one
    assert order(PriorityPolicy(), [seq(300, SeqStatus.RUNNING, priority=1), seq(301)]) == [301, 300]


# ---- decode bursts (gateway.bursts) --------------------------------------------------


def decode(arrival: int, executor: str = "e", interval: int = 64, max_tokens: int = 32, out: int = 0, **spec):
    """A running decode with ``out`` tokens generated, its stream interval and limits."""
    from gateway.state import Completion

    req = Request(f"r{arrival}", [1] * 8, SamplingSpec(max_tokens=max_tokens, stream_interval=interval, **spec), 0,
                  arrival=arrival)
    comp = Completion(0, None, output_ids=[2] * out)
    s = Seq(next(_ids), req, comp, [1] * (8 + out), executor, status=SeqStatus.RUNNING)
    s.num_computed = 8 + out - 1
    return s


def bursts(seqs, steps: int = 8, idle=("e",), **kw) -> dict[int, int]:
    batch = Scheduler(PriorityPolicy(), num_steps=steps, **kw).schedule(seqs, set(idle), max_model_len=1000)
    return {s.request.arrival: m for s, m in zip(batch.seqs, batch.lookahead or [0] * len(batch.seqs))}


def test_an_executor_of_running_decodes_bursts_within_their_limits():
    assert bursts([decode(0), decode(1, max_tokens=5, out=2)]) == {0: 7, 1: 2}  # 1 samples its last 3
    assert bursts([decode(0)], steps=1) == {0: 0}  # off
    # a client reading every 3 tokens (1 already out): a burst of 2 brings its delta on time
    assert bursts([decode(0), decode(1, interval=3, out=1)]) == {0: 1, 1: 1}
    assert bursts([decode(0), decode(1, interval=1)]) == {0: 0, 1: 0}


def test_no_burst_beside_other_work_or_a_row_that_steps_alone():
    assert bursts([decode(0), seq(1)]) == {0: 0, 1: 0}  # a waiting request: it prefills now
    assert bursts([decode(0), seq(1, SeqStatus.SWAPPED)]) == {0: 0, 1: 0}
    assert bursts([decode(0), decode(1)], max_running=1) == {0: 0}  # one left out of the step
    assert bursts([decode(0), decode(1, presence_penalty=0.5, penalized=True)]) == {0: 0, 1: 0}
    assert bursts([decode(0), decode(1, top_logprobs=2)]) == {0: 0, 1: 0}
    assert bursts([decode(0), decode(1, min_tokens=4, out=1)]) == {0: 0, 1: 0}
    # another executor's waiting request does not stop this one's burst
    assert bursts([decode(0), seq(1), decode(2, executor="f")], idle=("e", "f")) == {0: 0, 1: 0, 2: 7}


def test_the_burst_flag_is_bounded():
    import argparse

    from gateway.cli import add_scheduling_arguments

    p = argparse.ArgumentParser()
    add_scheduling_arguments(p)
    assert p.parse_args(["--num-scheduler-steps", "8"]).num_scheduler_steps == 8
    for bad in ("0", "65"):
        with pytest.raises(SystemExit):
            p.parse_args(["--num-scheduler-steps", bad])
