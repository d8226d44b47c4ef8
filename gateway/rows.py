"""What an executor computes in a step: rows built from its part of a plan.

A row is one sequence's tokens to compute and how its last position
samples (n first tokens, one token, beam candidates, logprobs, logit bias).
Building the rows also marks what the plan granted on the sequences:
admitted, running, computed through. With steps planned ahead
(docs/architecture.md, "Steps planned ahead") a row may end with a
placeholder: the token the executor is still sampling in the step before;
a decode burst's row ends with the placeholders of the tokens it samples
ahead (gateway.bursts), which the executor fills itself.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from kvpager.seq_status import SeqStatus
from kvpager.v1 import common_pb2
from gateway import wire
from gateway.beam import BeamSearch
from gateway.params import logit_bias_for
from gateway.request_stats import RequestStats
from gateway.state import Seq


class RowBuilder:
    def __init__(self, beams: BeamSearch, *, plan_ahead: bool, stats: RequestStats | None = None) -> None:
        self.beams = beams
        self.plan_ahead = plan_ahead
        self.stats = stats or RequestStats()

    def rows(self, ep: common_pb2.ExecutorPlan, seqs: Mapping[int, Seq], *,
             max_model_len: int, eos_ids: frozenset[int]) -> list[wire.Row]:
        rows = []
        for p in wire.plan_rows(ep, lambda seq_id: seqs[seq_id].num_computed):
            seq = seqs[p.seq_id]
            req = seq.request
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = p.cached
                self.stats.scheduled(req, time.perf_counter())
            seq.status = SeqStatus.RUNNING
            seq.num_computed = p.start + p.num_tokens
            row = wire.Row(seq, p.start, seq.tokens[p.start:seq.num_computed])
            # Placeholders at the memory service now: the tokens steps in flight sample
            # (counted before the Step) and those this plan granted to sample ahead.
            unknown = seq.num_computed - len(seq.tokens)
            row.burst = max(0, unknown - seq.placeholders)
            seq.placeholders += row.burst
            ahead = max(0, unknown - row.burst)  # tokens steps in flight sample before this row's first
            if unknown > 0:  # this row's: a fed one (the last of those in flight) and its burst's
                row.token_ids.extend([wire.PLACEHOLDER] * (seq.num_computed - max(p.start, len(seq.tokens))))
            spec = req.spec
            if spec.penalized and p.started and p.start:
                row.history = seq.tokens[:p.start]  # the executor keeps the rest (executor_service/history.py)
            if seq.num_computed >= len(seq.tokens):  # the last known (or pending) token: its logits are wanted
                if spec.beam_width > 1:
                    row.num_top = self.beams.top_k(req)
                else:
                    self._sampling(row, seq, ahead, max_model_len, eos_ids)
            rows.append(row)
        return rows

    def _sampling(self, row: wire.Row, seq: Seq, ahead: int, max_model_len: int,
                  eos_ids: frozenset[int]) -> None:
        req, spec = seq.request, seq.request.spec
        if spec.n > 1 and not seq.sampled_first:
            row.num_samples = spec.n                      # the prompt once, n first tokens
            row.seeds = [req.seed + j for j in range(spec.n)]
            num_output = 0
        else:
            row.num_samples = 1
            row.seeds = [req.seed + seq.completion.index]
            num_output = len(seq.completion.output_ids) + ahead
        row.num_top = spec.top_logprobs
        if spec.processed:
            row.bias = logit_bias_for(spec, num_output, eos_ids)
        seq.sampling += 1
        # A burst's next step is planned near its end (gateway.inflight), fed its last sample.
        seq.feed_ahead = self.plan_ahead and row.num_samples == 1 and \
            may_continue(seq, num_output + 1 + row.burst, max_model_len)


def may_continue(seq: Seq, num_output: int, max_model_len: int) -> bool:
    """Whether a sequence whose next token is being sampled can go on after it
    whatever it is, as far as lengths go (a stop token or string may still end
    it: the step fed with it is then wasted, and discarded)."""
    total = seq.num_computed + 1  # its tokens once the one being sampled is in
    return num_output < seq.request.spec.max_tokens and total < max_model_len
