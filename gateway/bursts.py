"""Decode bursts: how many tokens a running decode may sample ahead in one step.

With ``--num-scheduler-steps K`` (as vLLM's multi-step scheduling) an
executor whose every sequence is a running decode runs up to K one-token
forwards in one Execute, each fed its own last sample; the memory service
allocates the slots in one plan (``schedule_lookahead``). One Step and one
Execute then serve K tokens per sequence: the control plane's cost per
token drops K-fold. The price is what multi-step always costs: a stop
string or token found mid-burst wastes the rest of that burst's forwards
for that sequence (discarded, never streamed) and a sequence that ends
inside a burst is answered at the burst's end. A request arriving
mid-burst does not wait for its end: the step that prefills it is planned
at once, names the burst (``prev_step_id``) and cuts it short (``cut_prev``,
``may_cut``; ``--no-cut-bursts``: off): the executor ends the burst after
the forward it is in and runs the prefill next; the burst's rows get the
tokens it sampled, and the next Step gives the memory service back the
slots it did not compute (``Changes.cut``). Bursts only run while nothing
waits to prefill. With plan-ahead a burst's next step is planned near its
end (``--burst-plan-lead-ms``; gateway.inflight), fed its last sample: that
step never cuts it.

A row samples ahead only when every token of the burst samples the same way
it would one step at a time: one completion (not a beam, not the first
token of n > 1), no penalties (they need the tokens of the burst itself),
no top logprobs, past ``min_tokens`` (whose stop-token mask changes as
tokens come), and room left under ``max_tokens`` and the context limit.
Seeded sampling is keyed by (seed, position), so a burst draws exactly what
single steps draw.

A client reading every token (or every k: ``stream_interval``) gets each
delta no later than without bursts: a burst longer than some sequence's
wait for its next delta goes out as ExecuteStream, whose sub-steps come
back as they end (gateway.results takes their tokens at once, streams them
and checks them for stops). One reading only the end (non-streaming HTTP,
offline batches) gets a burst answered whole, in one message.

Nor is it longer, in time, than ``max_burst_ms`` of the executor's measured
one-token forwards (``DecodeClock``): what a request arriving mid-burst
waits at most where bursts are not cut (an executor with a table per KV
group never cuts), on a small model (8 tokens of a 30M model, ~5 ms each)
and on a large one (a 0.5B model's 45 ms forwards: no burst at 30 ms)
alike. An executor not measured yet does not burst.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.outputs import first_at_once
from gateway.state import PLACEHOLDER, Seq

# The longest burst: the executor's MAX_DECODE_STEPS, the memory service's MAX_LOOKAHEAD + 1.
MAX_STEPS = 64


@dataclass(slots=True)
class DecodeClock:
    """Seconds per one-token forward of each executor, from its Executes of
    decodes only (the executor's own forward and sampling timers: no queueing,
    no transport), as an exponential moving average (an executor restarted
    under the same id moves it within a few steps): what bounds a burst's
    length. And seconds per sub-step of its bursts as the gateway sees them
    (``wall``: from the burst's start to its result, so the executor's work
    between forwards and the streamed parts too, ~15 % more on a 2-core
    machine): when a burst ends, for planning its next step near that end."""

    alpha: float = 0.2
    seconds: dict[str, float] = field(default_factory=dict)  # executor id -> seconds per forward
    wall: dict[str, float] = field(default_factory=dict)     # executor id -> seconds per burst sub-step

    def observe(self, executor_id: str, rows, forward_s: float, sample_s: float, ran: int = 0,
                wall_s: float | None = None) -> None:
        """``rows`` (gateway.wire.Row) came back with these timers; only a step
        whose every row computes one known token plus its burst counts.
        ``ran``: the sub-steps a burst cut short ran (0: all). ``wall_s``: the
        seconds from its start (``inflight.Call.started``) to its result (None:
        its start is not known)."""
        if not rows or any(r.num_samples != 1 or len(r.token_ids) != 1 + r.burst for r in rows):
            return
        steps = ran or 1 + max(r.burst for r in rows)
        _average(self.seconds, executor_id, (forward_s + sample_s) / steps, self.alpha)
        if wall_s is not None and steps > 1:
            _average(self.wall, executor_id, wall_s / steps, self.alpha)

    def per_sub_step(self, executor_id: str) -> float:
        """Seconds a burst's sub-step of this executor takes end to end (its
        forwards' time until a burst has been timed whole; 0.0: unknown)."""
        return self.wall.get(executor_id) or self.seconds.get(executor_id, 0.0)

    def limits(self, max_steps: int, max_burst_s: float) -> dict[str, int]:
        """Executor id -> the longest burst (1: none) within ``max_burst_s``."""
        return {eid: max(1, min(max_steps, int(max_burst_s / s))) if s > 0 else max_steps
                for eid, s in self.seconds.items()}


def _average(into: dict[str, float], key: str, value: float, alpha: float) -> None:
    old = into.get(key)
    into[key] = value if old is None else old + alpha * (value - old)


NEVER = float("inf")


def next_plan_at(started: float | None, rows: list, per_step_s: float, lead_s: float) -> float:
    """When (perf_counter) the step after an Execute with ``rows`` that the
    executor started at ``started`` may be planned: at once (0.0) after a
    one-token step; after a burst, ``lead_s`` (at least one sub-step) before
    it should end (``per_step_s``: DecodeClock.per_sub_step), so the executor
    finds the next one queued instead of idling while the result, the Step and
    the Execute travel (~4-6 ms between bursts on a 2-core machine,
    docs/benchmarks.md). Not earlier: while two steps are in flight a request
    that arrives waits for the first to end before it is planned, where one
    arriving earlier cuts the burst at once. A burst not started yet (queued
    behind another step: ``started`` None) or ``lead_s`` 0: NEVER (planned
    once the step before it returns, or it returns)."""
    steps = max((r.burst for r in rows), default=0) + 1
    if steps == 1:
        return 0.0
    if not lead_s or started is None:
        return NEVER
    return started + steps * per_step_s - max(lead_s, per_step_s)


def may_cut(burst_rows: list, rows: list, preempted: set[int]) -> bool:
    """Whether a step (``rows``) planned while a burst (``burst_rows``) runs on
    its executor may cut that burst short: when it prefills (a request that
    arrived, a chunk of a long prompt), not when it only decodes other
    sequences (two groups of decodes take turns while plan-ahead hides each
    one's planning; cutting each other's bursts, neither would burst), and
    not when its plan preempted one of the burst's sequences (their blocks
    are already moving), and not when it feeds a sequence the burst's last
    sample (planned near the burst's end: it needs the whole burst)."""
    return any(r.burst for r in burst_rows) and any(len(r.token_ids) - r.burst > 1 for r in rows) \
        and not any(r.seq.seq_id in preempted for r in burst_rows) and not fed_by_burst(burst_rows, rows)


def fed_by_burst(burst_rows: list, rows: list) -> bool:
    """Whether a step (``rows``) feeds sequences the last samples of a burst
    (``burst_rows``) that still runs: planned near the burst's end."""
    return any(r.burst for r in burst_rows) and any(r.token_ids and r.token_ids[0] == PLACEHOLDER for r in rows)


def room(seq: Seq, fed: int, max_model_len: int) -> int:
    """Tokens ``seq`` may sample in one burst (>= 1), or 0 when it must step
    one token at a time (then its executor does not burst: its one token per
    step would wait for everyone's burst). ``fed``: its tokens that steps in
    flight sample and this step feeds (0; 1 behind a one-token step; a burst
    planned ahead, the running burst's tokens not yet back and its last sample)."""
    req = seq.request
    spec = req.spec
    if spec.beam_width > 1 or spec.penalized or spec.top_logprobs or (spec.n > 1 and not seq.sampled_first) \
            or seq.completion is None:
        return 0
    num_output = len(seq.completion.output_ids) + fed  # before the burst's first sample
    if num_output < spec.min_tokens:
        return 0
    total = len(seq.tokens) + fed  # its tokens once those in flight are in
    # The memory service holds at most MAX_STEPS + 1 unknown tokens per sequence
    # (memory_service.sequence: MAX_PENDING + MAX_LOOKAHEAD): those fed and the burst's.
    return max(1, min(spec.max_tokens - num_output, max_model_len - total, MAX_STEPS + 2 - fed))


def to_next_delta(seq: Seq, fed: int) -> int:
    """Tokens until ``seq``'s next streamed delta (its request's
    stream_interval): a burst no longer than this delivers it no later."""
    comp = seq.completion
    num_output = len(comp.output_ids) + fed
    # A first token still being sampled (fed ahead) is streamed the moment it comes back.
    sent = max(comp.sent_tokens, 1) if num_output and first_at_once(seq.request) else comp.sent_tokens
    return max(1, sent + seq.request.spec.stream_interval - num_output)


def lookaheads(seqs: list[Seq], fed: list[int], steps: int, max_model_len: int) -> tuple[list[int], bool]:
    """One executor's decodes (all running, all in the step): the tokens each
    samples ahead in a burst of at most ``steps``, and whether the burst must
    answer sub-step by sub-step (ExecuteStream): some sequence's client waits
    for a delta before the burst's end, and gets each no later than without
    bursts. A sequence that must step one at a time turns bursts off for the
    executor."""
    rooms = []
    for s, f in zip(seqs, fed):
        r = room(s, f, max_model_len)
        if not r:
            return [0] * len(seqs), False
        rooms.append(r)
    ahead = [min(steps, r) - 1 for r in rooms]
    streamed = any(a and to_next_delta(s, f) <= a for s, f, a in zip(seqs, fed, ahead))
    return ahead, streamed
