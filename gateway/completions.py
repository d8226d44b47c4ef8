"""What sampled tokens do to requests, and the narrow interface through
which parallel sampling and beam search change sequences.

A token is checked against the completion's stop conditions, streamed (held
back while it might still become a stop string), and then either joins its
sequence (sent to the memory service with the next Step) or ends it; the
request ends once every completion has. With n > 1 the prompt is computed
once and its first sample fans out into forks. ``Completions`` is also the
``gateway.beam.SequenceOps`` beam search uses: fork, append, free, emit,
finish.
"""

from __future__ import annotations

from kvpager.errors import Internal
from kvpager.telemetry import get_logger
from gateway import metrics
from gateway.membership import Executors
from gateway.outputs import Outbox, accept_token, take_output
from gateway.requests import RequestBook
from gateway.sequences import SequenceTable
from gateway.state import Completion, Finish, Output, Request, Seq

log = get_logger("gateway.engine")


class Completions:
    def __init__(self, sequences: SequenceTable, requests: RequestBook, outbox: Outbox,
                 executors: Executors) -> None:
        self.sequences = sequences
        self.requests = requests
        self.outbox = outbox
        self.executors = executors

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.executors.eos_ids

    # ---- tokens ---------------------------------------------------------------------

    def accept(self, seq: Seq, comp: Completion, token: int, logprob: float | None,
               top: list[tuple[int, float]] | None = None) -> None:
        req = seq.request
        finish = accept_token(req, comp, token, logprob, self.eos_ids, len(seq.tokens) + 1,
                              self.executors.limits.max_model_len, top)
        out = take_output(req, comp)
        if out is not None:
            self.outbox.emit(req, out)
        if finish is Finish.NONE:
            self.sequences.append(seq, token)
            return
        self.sequences.release(seq)
        if all(c.finish is not Finish.NONE for c in req.completions):
            self.requests.end(req)

    def take(self, seq: Seq, tokens: list[int], logprobs: list, top: list[tuple[int, float]] | None,
             burst: bool) -> int:
        """A row's samples for ``seq``: n first tokens (they fan out), one token,
        or a decode burst's tokens in order until one ends the sequence (the rest
        were computed past its end: discarded). Returns the tokens taken."""
        if burst:
            for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
                if seq.seq_id not in self.sequences:
                    metrics.TOKENS_SAMPLED_AHEAD_DISCARDED.inc(len(tokens) - i)
                    return i
                self.accept(seq, seq.completion, token, logprob, None)
            return len(tokens)
        if len(tokens) > 1:
            self.fan_out(seq, tokens, logprobs, top)
        else:
            self.accept(seq, seq.completion, tokens[0], logprobs[0], top)
        return len(tokens)

    def fan_out(self, parent: Seq, tokens: list[int], logprobs: list,
                top: list[tuple[int, float]] | None = None) -> None:
        """n > 1: the prompt was computed once; each completion gets its own
        first token (the same alternatives: one position), children share the
        parent's blocks (copy-on-write)."""
        parent.sampled_first = True
        req = parent.request
        children = self.sequences.fork(parent, req.completions[1:len(tokens)], sampled_first=True)
        self.accept(parent, parent.completion, tokens[0], logprobs[0], top)
        for child, tok, lp in zip(children, tokens[1:], logprobs[1:]):
            self.accept(child, child.completion, tok, lp, top)

    def fail_on_bug(self, req: Request, doing: str) -> None:
        """End one request with INTERNAL (its blocks freed next step) after an
        unexpected exception while processing it; the step goes on for the rest."""
        log.exception("request failed inside the engine", request_id=req.request_id, doing=doing)
        self.requests.fail(req, Internal(f"internal error while {doing}; request {req.request_id} ended"))

    # ---- SequenceOps ------------------------------------------------------------------

    def fork(self, parent: Seq, completions: list[Completion | None]) -> list[Seq]:
        return self.sequences.fork(parent, completions)

    def append(self, seq: Seq, token: int) -> None:
        self.sequences.append(seq, token)

    def free(self, seq: Seq) -> None:
        self.sequences.release(seq)

    def emit(self, req: Request, out: Output) -> None:
        self.outbox.emit(req, out)

    def finish(self, req: Request) -> None:
        self.requests.end(req)
