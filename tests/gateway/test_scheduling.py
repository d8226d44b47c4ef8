"""The step order: priority is honoured by default, and where no request sets
one the default order is exactly FCFS (running first, then arrival)."""

from __future__ import annotations

import itertools

import pytest

from gateway.bursts import DecodeClock
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


def plan(seqs, steps: int = 8, idle=("e",), forward_s: dict | None = None, hold=(), **kw):
    """One schedule; each executor measured at ``forward_s`` (default 1 ms per forward)."""
    clock = DecodeClock(seconds=forward_s if forward_s is not None else dict.fromkeys(idle, 0.001))
    return Scheduler(PriorityPolicy(), num_steps=steps, clock=clock, **kw).schedule(seqs, set(idle),
                                                                                   max_model_len=1000, hold=hold)


def bursts(seqs, **kw) -> dict[int, int]:
    """Lookaheads of one schedule (``plan``), by arrival."""
    batch = plan(seqs, **kw)
    return {s.request.arrival: m for s, m in zip(batch.seqs, batch.lookahead or [0] * len(batch.seqs))}


def streamed(seqs, **kw) -> tuple[dict[int, int], set[str]]:
    """Lookaheads by arrival, and the executors whose burst answers sub-step by sub-step."""
    batch = plan(seqs, **kw)
    return {s.request.arrival: m for s, m in zip(batch.seqs, batch.lookahead)}, batch.streamed


def row(burst: int = 0, num_samples: int = 1, tokens: int = 1):
    from gateway.wire import PLACEHOLDER, Row

    return Row(None, 0, [5] * tokens + [PLACEHOLDER] * burst, num_samples=num_samples, burst=burst)


def test_a_burst_lasts_at_most_max_burst_ms_of_the_executors_measured_forwards():
    assert bursts([decode(0)], forward_s={"e": 0.005}) == {0: 5}       # 30 ms / 5 ms: 6 tokens, 5 ahead
    assert bursts([decode(0)], forward_s={"e": 0.045}) == {0: 0}       # a 0.5B model's forward: no burst
    assert bursts([decode(0)], forward_s={}) == {0: 0}                 # not measured yet: no burst
    assert bursts([decode(0)], forward_s={"e": 0.005}, max_burst_s=0.1) == {0: 7}  # then num_steps bounds it
    assert bursts([decode(0), decode(1, executor="f")], idle=("e", "f"),
                  forward_s={"e": 0.001, "f": 0.01}) == {0: 7, 1: 2}   # each executor its own


def test_the_decode_clock_times_forwards_of_decode_steps_only():
    clock = DecodeClock(alpha=0.5)
    clock.observe("e", [row(), row(tokens=7)], 0.05, 0.01)             # a prefill beside: not a decode step
    clock.observe("e", [row(num_samples=2)], 0.05, 0.01)               # n first tokens
    clock.observe("e", [], 0.05, 0.01)
    assert clock.seconds == {}
    clock.observe("e", [row(burst=3), row(burst=1)], 0.018, 0.002)     # 4 forwards
    assert clock.seconds == {"e": pytest.approx(0.005)}
    clock.observe("e", [row()], 0.008, 0.001)                          # one forward: the average moves halfway
    assert clock.seconds == {"e": pytest.approx(0.007)}
    assert clock.limits(8, 0.03) == {"e": 4}


def test_an_executor_of_running_decodes_bursts_within_their_limits():
    assert bursts([decode(0), decode(1, max_tokens=5, out=2)]) == {0: 7, 1: 2}  # 1 samples its last 3
    assert bursts([decode(0)], steps=1) == {0: 0}  # off


def test_a_burst_answers_sub_step_by_sub_step_when_a_client_waits_for_tokens_before_its_end():
    # nobody waits before the end: answered whole
    assert streamed([decode(0), decode(1, interval=32, max_tokens=32, out=1)]) == ({0: 7, 1: 7}, set())
    # a client reading every token, or every 3 after its first (out at once): as long, streamed
    assert streamed([decode(0), decode(1, interval=1)]) == ({0: 7, 1: 7}, {"e"})
    assert streamed([decode(0), decode(1, interval=3, out=1)]) == ({0: 7, 1: 7}, {"e"})
    # the next delta due with the burst's last token: it comes with the whole response
    assert streamed([decode(0, interval=8, out=1)]) == ({0: 7}, set())
    assert streamed([decode(0, interval=7, out=1)]) == ({0: 7}, {"e"})
    # a row whose next delta is its last (it ends within the burst) gets it with the whole response
    ending = decode(0, interval=4, max_tokens=8, out=4)
    ending.completion.sent_tokens = 4
    assert streamed([ending]) == ({0: 3}, set())
    # each executor on its own
    assert streamed([decode(0, interval=1), decode(1, executor="f")], idle=("e", "f")) == ({0: 7, 1: 7}, {"e"})


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
    assert p.parse_args([]).max_burst_ms == 30.0
    assert p.parse_args(["--max-burst-ms", "0"]).max_burst_ms == 0.0
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit):
            p.parse_args(["--max-burst-ms", bad])
        with pytest.raises(SystemExit):
            p.parse_args(["--burst-plan-lead-ms", bad])
        with pytest.raises(SystemExit):
            p.parse_args(["--arrival-settle-ms", bad])
    assert p.parse_args([]).burst_plan_lead_ms == 6.0
    assert p.parse_args(["--burst-plan-lead-ms", "0"]).burst_plan_lead_ms == 0.0
    assert p.parse_args([]).arrival_settle_ms == 3.0
    assert p.parse_args(["--arrival-settle-ms", "0"]).arrival_settle_ms == 0.0


def test_only_a_step_that_prefills_cuts_the_burst_running_before_it():
    from gateway.bursts import may_cut

    running = [row(burst=3), row(burst=0)]
    for i, r in enumerate(running):
        r.seq = decode(90 + i)
    prefill, decode_only = [row(tokens=9)], [row(), row(burst=2)]
    assert may_cut(running, prefill, set())
    assert not may_cut(running, decode_only, set())  # two groups of decodes take turns: neither cuts the other
    assert not may_cut(running[1:], prefill, set())  # not a burst
    assert not may_cut(running, prefill, {running[0].seq.seq_id})  # the step preempted one of its sequences
    # a step fed the burst's last sample (planned near its end) needs all of it: no cut
    fed = row(tokens=0, burst=3)
    fed.token_ids.insert(0, fed.token_ids[0])
    assert not may_cut(running, [*prefill, fed], set())


def in_burst(arrival: int, burst: int, taken: int = 0, **kw):
    """A running decode whose burst of 1 + ``burst`` tokens is in flight with
    ``taken`` of them back (as RowBuilder and the results leave it), fed ahead."""
    s = decode(arrival, **kw)
    s.num_computed += 1 + burst            # its last known token and the burst's placeholders
    s.placeholders = burst - taken
    s.tokens += [3] * taken
    s.completion.output_ids += [3] * taken
    s.feed_ahead = True
    return s


def test_a_burst_in_flight_is_fed_its_last_sample_unless_held():
    from gateway.scheduling import fed_tokens

    s = in_burst(0, burst=5, taken=2)
    assert fed_tokens(s) == 4                                # 3 not back + the last sample
    batch = plan([s], forward_s={"e": 0.001})
    assert batch.num_tokens == [1] and batch.fed == [4]
    assert batch.lookahead == [7]                            # then a burst of its own
    assert not plan([in_burst(0, burst=5)], hold={"e"})      # held: not near the burst's end yet
    # not fed: a plain running decode; one whose last token is known but not computed (a burst cut short)
    assert fed_tokens(decode(1)) == 0
    cut = decode(2)
    cut.feed_ahead = True
    assert fed_tokens(cut) == 0 and plan([cut]).fed == [0]


def test_a_fed_bursts_lookahead_leaves_the_memory_services_bound():
    from gateway.bursts import MAX_STEPS, room

    s = in_burst(0, burst=60, max_tokens=1000)
    assert room(s, 61, 10_000) == MAX_STEPS + 2 - 61          # 61 unknown and 4 ahead: 65 held at most
    assert room(s, 70, 10_000) == 1                           # none ahead


def test_a_bursts_next_step_is_planned_near_its_end():
    from gateway.bursts import NEVER, next_plan_at

    burst = [row(burst=7), row(burst=3)]                      # 8 forwards
    assert next_plan_at(10.0, [row(), row()], 0.005, 0.006) == 0.0               # one-token step: at once
    assert next_plan_at(10.0, burst, 0.005, 0.006) == pytest.approx(10.0 + 0.040 - 0.006)
    assert next_plan_at(10.0, burst, 0.010, 0.006) == pytest.approx(10.0 + 0.080 - 0.010)  # >= one forward
    assert next_plan_at(10.0, burst, 0.005, 0.0) == NEVER                        # lead 0: after it returns
    assert next_plan_at(None, burst, 0.005, 0.006) == NEVER   # queued behind another step: not started yet
    assert next_plan_at(None, [row()], 0.005, 0.006) == 0.0


def test_a_burst_ends_by_the_gateways_clock_of_its_sub_steps_once_one_was_timed_whole():
    """Planning near a burst's end reads its sub-steps end to end (the
    executor's work between forwards, the streamed parts): by the forward
    timers alone a burst of 8 at 4.25 ms a sub-step looked 5 ms shorter, and
    the next step, planned that early, held every arrival behind two steps."""
    clock = DecodeClock(alpha=0.5)
    burst = [row(burst=7), row(burst=3)]                      # 8 sub-steps
    assert clock.per_sub_step("e") == 0.0                      # nothing timed
    clock.observe("e", burst, 0.028, 0.001)                    # no start known: forwards only
    assert clock.per_sub_step("e") == pytest.approx(0.029 / 8) and clock.wall == {}
    clock.observe("e", [row()], 0.004, 0.0, wall_s=0.006)      # one token: no sub-steps to time
    assert clock.wall == {}
    clock.observe("e", burst, 0.028, 0.001, wall_s=0.034)
    assert clock.per_sub_step("e") == pytest.approx(0.034 / 8)
    clock.observe("e", burst, 0.028, 0.001, ran=4, wall_s=0.021)  # cut short after 4
    assert clock.wall["e"] == pytest.approx((0.034 / 8 + 0.021 / 4) / 2)
    forwards_only = DecodeClock(seconds=dict(clock.seconds))
    assert clock.limits(8, 0.02) == forwards_only.limits(8, 0.02) == {"e": 3}  # lengths still by the forwards


def test_a_step_queued_behind_another_starts_when_that_one_comes_back():
    from types import SimpleNamespace

    from gateway.inflight import Call, bursts_running, next_burst_plan, take_returned

    def call(eid, done, started=None):
        ex, task = SimpleNamespace(executor_id=eid), SimpleNamespace(done=lambda: done)
        return Call(ex, task, [row(burst=7)], sent=0.0, step_start=0.0, started=started)

    clock = DecodeClock(seconds={"e": 0.005, "f": 0.005})
    e1, e2, f1, f2 = call("e", True, 1.0), call("e", False), call("f", False, 1.0), call("f", True)
    assert bursts_running([e2], 2.0, clock, 0.006) == {"e"}   # queued: its sequences held
    assert next_burst_plan([e2], 2.0, clock, 0.006) == 0.0    # and no time to plan after it yet
    done, pending = take_returned([e1, e2, f1, f2], 2.0)
    assert done == [e1] and pending == [e2, f1, f2]           # f2 came back behind f1: applied after it
    assert e2.started == 2.0 and f2.started is None and f1.started == 1.0
    assert next_burst_plan(pending, 2.0, clock, 0.006) == pytest.approx(2.0 + 0.040 - 0.006)
    assert bursts_running(pending, 2.0 + 0.035, clock, 0.006) == {"f"}  # e near its end, f's start unknown
