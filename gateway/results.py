"""What an Execute's samples do to the engine's sequences: the whole
response when the call returns, or a decode burst's sub-steps as they end.

A burst sent with ExecuteStream (gateway.bursts: some row's client waits
for tokens before the burst's end) answers each sub-step but the last as
it ends: its tokens are taken at once (streamed, checked for stops, appended
for the next Step), each row counting what it took (``Row.taken``); the
whole response then applies only what is left. A sequence ended by a token
mid-burst (a stop token or string, an abort) takes no more: the rest of its
burst is discarded, as when the burst comes back whole. A burst cut short
(a step waited behind it) returns what it ran; the rest is given back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpager.packed import unpack_f32, unpack_i32
from kvpager.telemetry import get_logger
from kvpager.v1 import executor_pb2
from gateway import metrics, wire
from gateway.beam import BeamSearch
from gateway.completions import Completions
from gateway.request_stats import RequestStats
from gateway.rows import may_continue
from gateway.sequences import SequenceTable
from gateway.state import Request

log = get_logger("gateway.engine")


class Results:
    def __init__(self, sequences: SequenceTable, completions: Completions, beams: BeamSearch,
                 stats: RequestStats, max_model_len: Callable[[], int] = lambda: 0) -> None:
        self.sequences = sequences
        self.completions = completions
        self.beams = beams
        self.stats = stats
        self.max_model_len = max_model_len  # the executors' context limit now (whether a sample may be fed on)

    def whole(self, rows: list[wire.Row], resp: executor_pb2.ExecuteResponse) -> list[wire.Row]:
        """A returned Execute: every row's samples (less what sub-steps took
        already). Returns the rows of a cut burst's next sub-step, carried
        into the step that cut it (``_cut``), for that step's call: they come
        back after its own rows."""
        sampled: dict[Request, int] = {}  # tokens per request (a beam's candidates count one)
        for row in rows:
            if row.num_samples:
                row.seq.sampling -= 1
                if not row.seq.sampling:
                    row.seq.feed_ahead = False
        for result in wire.row_results(rows, resp):
            seq = result.row.seq
            req = seq.request
            if result.row.carried and seq.seq_id in self.sequences.changes.carried:
                # Its sample comes before the memory service heard of the cut: with it appended, a plain
                # cut says the same (every token but this last one computed), or nothing where the
                # carried sub-step was its burst's last (it computed all the burst planned).
                self.sequences.changes.carried.remove(seq.seq_id)
                if result.row.rest:
                    self.sequences.changes.cut.append(seq.seq_id)
            if result.row.num_top and not result.row.num_samples:
                sampled[req] = sampled.get(req, 0) + 1
                self.beams.candidates(seq, result.top_ids, result.top_logprobs)
                continue
            tokens, logprobs = result.tokens, result.logprobs
            if result.row.taken:
                tokens, logprobs = tokens[result.row.taken:], logprobs[result.row.taken:]
                if not tokens:
                    continue
            self._take(sampled, seq, tokens, logprobs, result.top, bool(result.row.burst))
        carried = self._cut(rows, resp.sub_steps_run, resp.sub_step_carried) if resp.sub_steps_run else []
        self.beams.finish_step()
        self.stats.tokens(sampled, time.perf_counter())
        return carried

    def _cut(self, rows: list[wire.Row], ran: int, carried: bool) -> list[wire.Row]:
        """The burst was cut short after ``ran`` sub-steps (a step waited behind
        it): each row it cut computed ``ran`` tokens, the last sample is its
        next to compute, and the memory service gives the rest back in the
        next Step (its placeholders, its slots). ``carried``: the step that
        cut it computed that last sample too (executor_service.carry) and
        samples each such row's next token, as a step in flight does: the
        sequences may be fed it. Returns those rows (one token each; those
        of sequences ended since too, whose samples are then discarded)."""
        out = []
        for row in rows:
            seq, rest = row.seq, row.num_samples + row.burst - ran - 1
            if rest < 0:
                continue
            if carried:  # one per row it cut, ended or not: the samples come back in the burst's row order
                seq.sampling += 1
                out.append(wire.Row(seq, row.start + ran, seq.tokens[row.start + ran:row.start + ran + 1],
                                    num_samples=1, seeds=row.seeds, carried=True, rest=rest))
            if seq.seq_id not in self.sequences:
                continue
            metrics.TOKENS_SAMPLED_AHEAD_CUT.inc(rest + 1 - carried)
            seq.num_computed = row.start + ran + carried
            seq.placeholders = 0
            if carried:
                self.sequences.changes.carried.append(seq.seq_id)
                seq.feed_ahead = may_continue(seq, len(seq.completion.output_ids) + 1, self.max_model_len())
            else:
                self.sequences.changes.cut.append(seq.seq_id)
        return out

    def take_parts(self, calls: list, current: Callable[[str], object]) -> bool:
        """Take the sub-steps come back for each executor's oldest call in
        flight (``calls``: oldest first, each with ``ex``, ``rows``, ``parts``;
        an executor's results go in step order), none for an executor no
        longer ``current``. Whether any was taken."""
        seen: set[str] = set()
        taken = False
        for call in calls:
            eid = call.ex.executor_id
            if call.parts and eid not in seen and current(eid) is call.ex:
                parts = call.parts[:]
                call.parts.clear()  # in place: the call's task appends to this very list
                for msg in parts:
                    self.part(call.rows, msg)
                taken = True
            seen.add(eid)
        return taken

    def part(self, rows: list[wire.Row], msg: executor_pb2.ExecuteResponse) -> None:
        """Sub-step ``msg.sub_step`` of a streamed burst: one token for each row still going."""
        j = msg.sub_step
        going = [row for row in rows if row.num_samples and row.burst >= j and row.taken == j]
        tokens = unpack_i32(msg.sampled_token_ids)
        logprobs = unpack_f32(msg.sampled_logprobs) if msg.sampled_logprobs else None
        if len(tokens) != len(going) or (logprobs is not None and len(logprobs) != len(going)):
            # The whole response still brings them; a stream out of step is a bug to see, not to act on.
            log.warning("a burst sub-step does not match its rows: left to the whole response", sub_step=j,
                        tokens=len(tokens), rows=len(going))
            return
        metrics.TOKENS_STREAMED_MID_BURST.inc(len(going))
        sampled: dict[Request, int] = {}
        for i, row in enumerate(going):
            row.taken += 1
            self._take(sampled, row.seq, [int(tokens[i])], [None if logprobs is None else float(logprobs[i])],
                       None, True)
        self.stats.tokens(sampled, time.perf_counter())

    def _take(self, sampled: dict[Request, int], seq, tokens: list[int], logprobs: list, top, burst: bool) -> None:
        req = seq.request
        if seq.seq_id not in self.sequences:  # ended while the step ran (aborted, or a stop mid-burst)
            sampled[req] = sampled.get(req, 0) + len(tokens)
            if burst:
                metrics.TOKENS_SAMPLED_AHEAD_DISCARDED.inc(len(tokens))
            return
        try:
            sampled[req] = sampled.get(req, 0) + self.completions.take(seq, tokens, logprobs, top, burst)
        except Exception:  # one request's bug must not end the others' streams
            self.completions.fail_on_bug(req, "taking its sampled tokens")
