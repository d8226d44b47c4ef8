"""The step order: priority is honoured by default, and where no request sets
one the default order is exactly FCFS (running first, then arrival)."""

from __future__ import annotations

import itertools

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
