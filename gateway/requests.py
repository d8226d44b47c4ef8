"""The requests in flight and how each one ends.

A request is admitted (its completions and first sequence made), then ends
exactly once: finished (every completion has a finish reason), aborted (a
client cancel, ``Abort``, or its deadline: the completions end ABORT) or
failed with an error. Ending releases its sequences (the memory service
frees them in the next Step) and closes its stream through the outbox.
Mutated only by the engine loop (``abort`` only records the wish).

Requests belong to their caller (``Request.owner``: the authenticated
principal, or the connection without authentication): request ids are
unique per owner, and an owner can abort only its own requests; to anyone
else an id in use is as unknown as any other.
"""

from __future__ import annotations

import itertools
import random
import time

from kvpager.errors import AlreadyExists, DeadlineExceeded, KvpagerError, ResourceExhausted
from kvpager.prefix_index.hashing import PromptChain
from gateway import metrics
from gateway.detokenizer import IncrementalDetokenizer
from gateway.outputs import Outbox, take_output
from gateway.request_stats import RequestStats
from gateway.sequences import SequenceTable
from gateway.state import Completion, Finish, Request


class RequestBook:
    def __init__(self, sequences: SequenceTable, outbox: Outbox, max_waiting: int,
                 stats: RequestStats | None = None) -> None:
        self.sequences = sequences
        self.outbox = outbox
        self.stats = stats or RequestStats()
        self.max_waiting = max_waiting
        self.requests: dict[tuple[str, str], Request] = {}  # (owner, request id) -> request
        self._arrivals = itertools.count()
        self._aborts: dict[tuple[str, str], KvpagerError | None] = {}  # request key -> its error (None: plain abort)

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, key: tuple[str, str] | str) -> bool:
        """A request key, or (for operators and tests) a bare id under any owner."""
        if isinstance(key, str):
            return any(request_id == key for _, request_id in self.requests)
        return key in self.requests

    def values(self):
        return self.requests.values()

    def new(self, request_id: str, prompt_ids: list[int], spec, *, seed: int | None, priority: int,
            cache_salt: str, deadline: float | None, skip_special_tokens: bool,
            chain: PromptChain | None = None, arrival_s: float | None = None, owner: str = "") -> Request:
        return Request(request_id, prompt_ids, spec, seed if seed is not None else random.getrandbits(62),
                       priority=priority, cache_salt=cache_salt, arrival=next(self._arrivals), deadline=deadline,
                       skip_special_tokens=skip_special_tokens,
                       chain=chain if chain is not None else PromptChain(prompt_ids, cache_salt),
                       arrival_s=time.perf_counter() if arrival_s is None else arrival_s, owner=owner)

    def admit(self, req: Request, executor_id: str, tokenizer):
        """Take a validated request (nothing is allocated yet); returns its first sequence."""
        if req.key in self.requests:  # only ever the caller's own request
            raise AlreadyExists(f"request id {req.request_id!r} is in use by another of your requests",
                                param="request_id")
        if len(self.requests) >= self.max_waiting:
            raise ResourceExhausted(f"{len(self.requests)} requests in flight; the limit is {self.max_waiting}",
                                    retry_after_s=1.0)
        req.executor_id = executor_id
        req.completions = [Completion(i, IncrementalDetokenizer(tokenizer, req.prompt_ids, req.skip_special_tokens))
                           for i in range(req.spec.num_completions)]
        seq = self.sequences.start(req, None if req.spec.beam_width > 1 else req.completions[0])
        self.requests[req.key] = req
        metrics.REQUESTS_IN_FLIGHT.set(len(self.requests))
        return seq

    # ---- aborts --------------------------------------------------------------------

    def abort(self, key: tuple[str, str], error: KvpagerError | None = None) -> bool:
        """Ask for a request (by ``Request.key``) to end (applied by the loop,
        before its next Step). False: the owner has no request of that id."""
        if key not in self.requests:
            return False
        self._aborts[key] = error
        return True

    @property
    def aborts_pending(self) -> bool:
        return bool(self._aborts)

    def apply_aborts(self, now: float) -> None:
        """End the requests asked to end, and those past their deadline (loop time ``now``)."""
        for req in self.requests.values():
            if req.deadline is not None and now > req.deadline and req.key not in self._aborts:
                self._aborts[req.key] = DeadlineExceeded("request deadline passed")
        aborts, self._aborts = self._aborts, {}
        for key, error in aborts.items():
            req = self.requests.get(key)
            if req is None:
                continue
            if error is None:
                for comp in req.completions:
                    if comp.finish is Finish.NONE:
                        comp.finish = Finish.ABORT
                        out = take_output(req, comp)
                        if out is not None:
                            self.outbox.emit(req, out)
                self.end(req, abort=True)
            else:
                self.fail(req, error)
            metrics.ABORTS.inc()

    # ---- endings -----------------------------------------------------------------------

    def end(self, req: Request, abort: bool = False) -> None:
        """Every completion has ended (or is aborted): release and close the stream."""
        for seq in self.sequences.of_request(req):
            self.sequences.release(seq, abort=abort)
        self._close(req, Outbox.END, "abort" if abort else "ok", None)

    def fail(self, req: Request, error: KvpagerError, release: bool = True) -> None:
        """End with ``error``. ``release=False``: the memory service has dropped
        its sequences already (executor lost, state reset), forget them here only."""
        if req.done:
            return
        for seq in self.sequences.of_request(req):
            if release:
                self.sequences.release(seq, abort=True)
            else:
                self.sequences.forget(seq.seq_id)
        self._close(req, error, error.status.lower(), error)

    def fail_all(self, error: KvpagerError, release: bool = True) -> None:
        for req in list(self.requests.values()):
            self.fail(req, error, release=release)

    def _close(self, req: Request, last_item, outcome: str, error: KvpagerError | None) -> None:
        req.done = True
        admitted = self.requests.pop(req.key, None) is req
        self.outbox.emit(req, last_item)
        metrics.REQUESTS_IN_FLIGHT.set(len(self.requests))
        metrics.REQUESTS_FINISHED.labels(outcome).inc()
        if admitted:
            self.stats.finished(req, outcome, error)
