"""Streams that outlive a lost memory service or executor.

The gateway holds every live sequence's tokens (the prompt and every token
it accepted). When the memory service loses them (a Step fails UNAVAILABLE,
or NOT_FOUND / FAILED_PRECONDITION once it came back, rebuilt from the
mirror or cold) or the executor holding their KV dies, the sequences are
*rewound*: each gets a new sequence id and is admitted again as new, with all
its tokens as its prompt (recompute: whatever the prefix cache still holds is
a hit), on the same executor or, when that one is gone, on the least loaded
executor of the same model (model id, dtype, adapter). Sampling is keyed by
(seed, position) (executor_service/sampler.py), so the recomputed sequence
samples the tokens an undisturbed run would: the client sees a pause, not an
error. A memory service that lost its registry gets the gateway's executors
registered again (``Executors.reregister_missing``) rather than waiting for
their next heartbeat.

Bounds: a sequence rewound more than ``max_retries`` times ends UNAVAILABLE,
and so does one that waits longer than ``timeout_s`` for a memory service
(or an executor of its model) to take it again. A dead executor's sequences
with no executor of their model left end UNAVAILABLE at once; those of an
executor that only left the registry (the memory service restarted, or the
executor re-registered under a new incarnation) wait for it, up to
``timeout_s``.

Beam search resumes the same way: every running beam is rewound (new id,
its prompt and generated tokens as the prompt) while the search's state
(scores, finished hypotheses, the early-stop flag: ``BeamState``) stays
here. Candidates a beam gathered under its old id are dropped
(``BeamState.forget``): its recompute yields the candidates for the same
next position, so each beam's are taken exactly once and the search goes on
as undisturbed. Forks sent in the lost step (the children were confirmed
here as they were made) are rewound with the rest, their old ids freed like
the others'. A fork inherits its parent's ``retries``, so ``max_retries``
bounds a beam request whatever it prunes and forks.

The ids a rewound sequence had are freed at the memory service off the loop
(best effort, bounded by ``timeout_s``: a restarted service does not know
them, one whose reply was merely lost still holds them). Mutated only by the
engine loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvpager.errors import KvpagerError, NotFound, Unavailable
from kvpager.log_limits import LogLimiter, clip
from kvpager.telemetry import get_logger
from kvpager.v1 import memory_pb2
from gateway import failures, metrics
from gateway.clients import ExecutorClient, MemoryClient
from gateway.membership import Executors
from gateway.requests import RequestBook
from gateway.sequences import SequenceTable
from gateway.state import Request, Seq

log = get_logger("gateway.recovery")

ModelKey = tuple[str, str, str]
Ending = tuple[Request, "KvpagerError | None"]  # a request that cannot go on, and its error (None: the loss's own)
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 0.2  # a Step to a service that is down fails at once: cheap to retry


@dataclass(slots=True)
class RecoveryConfig:
    max_retries: int = 3       # rewinds one sequence may take; one more ends it UNAVAILABLE
    timeout_s: float = 30.0    # longest wait of a rewound sequence for a memory service or executor to take it


def model_key(ex: ExecutorClient) -> ModelKey:
    """What must match for another executor to continue a sequence token for token."""
    return ex.pool.model_id, ex.pool.dtype, ex.pool.adapter


@dataclass(slots=True)
class _Lost:
    since: float        # monotonic time of the loss
    model: ModelKey | None  # the model it must continue on (None: any the gateway serves)


class Recovery:
    def __init__(self, config: RecoveryConfig, sequences: SequenceTable, requests: RequestBook,
                 executors: Executors, memory: MemoryClient) -> None:
        if config.max_retries < 0 or config.timeout_s <= 0:
            raise ValueError("max_retries must be >= 0 and the recovery timeout > 0")
        self.config = config
        self.sequences = sequences
        self.requests = requests
        self.executors = executors
        self.memory = memory
        self._lost: dict[Seq, _Lost] = {}   # rewound (or waiting through an outage), not admitted again yet
        self._backoff_s = 0.0
        self._warnings = LogLimiter(10.0)
        self._reregistering: asyncio.Task | None = None
        # The executors served through when the memory service was lost (their pools as registered),
        # for registering them again with one that lost its registry; kept until every stream is back.
        self._pools: dict[str, memory_pb2.ExecutorPoolInfo] = {}

    @property
    def pending(self) -> bool:
        return bool(self._lost)

    # ---- the memory service ------------------------------------------------------------

    def memory_lost(self, cause: KvpagerError, stale: Iterable[int], sent_new: set[int]) -> list[Ending]:
        """The memory service lost (or may have lost) every sequence: rewind
        them all. Call once the Executes in flight are done (their samples are
        in the tokens). ``stale``: ids the failed Step was freeing; ``sent_new``:
        ids the failed Step admitted (it may have been applied). Returns the
        requests that cannot continue (the caller ends them, release=False)."""
        now = time.monotonic()
        stale = list(stale)
        ended = []
        for req, seqs in self._by_request(self.sequences).items():
            touched = [s for s in seqs if s.created or s.seq_id in sent_new]
            error = self._refusal(req, touched)
            if error is not False:
                stale += [s.seq_id for s in touched]
                ended.append((req, error))
                continue
            stale += self._rewind(touched, req.executor_id)
            for s in seqs:
                if s not in self._lost:
                    self._lost[s] = _Lost(now, None)
        self.free_stale(stale)
        self._pools.update({ex.executor_id: ex.pool for ex in self.executors.values() if ex.alive})
        if self._reregistering is None or self._reregistering.done():
            self._reregistering = asyncio.get_running_loop().create_task(
                self.executors.reregister_missing(list(self._pools.values())))
        ids = [clip(r.request_id, 40) for r in self.requests.values()][:failures.MAX_IDS_LOGGED]
        self._warnings.log(log.warning, "memory", "memory service lost the serving state; re-admitting",
                           error=clip(cause.message, 400), sequences=len(self._lost), requests_ended=len(ended),
                           request_ids=ids)
        return ended

    def backoff_s(self) -> float:
        """How long to wait before the next Step after a failed one (doubling)."""
        self._backoff_s = min(max(self._backoff_s * 2, BACKOFF_FIRST_S), BACKOFF_MAX_S)
        return self._backoff_s

    def step_ok(self, admitted: Iterable[Seq]) -> None:
        """A Step succeeded; ``admitted`` are the sequences it created."""
        self._backoff_s = 0.0
        if self._lost:
            for s in admitted:
                self._lost.pop(s, None)
        if not self._lost:
            self._pools.clear()

    # ---- executors -------------------------------------------------------------------

    def executor_lost(self, ex: ExecutorClient, cause: KvpagerError, left: bool) -> list[Ending]:
        """``ex`` is gone (already removed from the executors; the memory
        service dropped or drops what it held). Its requests move to the least
        loaded executor of its model; with none, they wait for one when ``ex``
        only ``left`` the registry. An executor that refused a step (any
        ``cause`` but UNAVAILABLE) did not die: its requests end, they are not
        handed to the next one. Returns those that cannot continue."""
        model = model_key(ex)
        target = self._target(model)
        movable = left or isinstance(cause, Unavailable)
        now = time.monotonic()
        moved = 0
        stale: list[int] = []
        seqs = self._by_request(self.sequences.of_executor(ex.executor_id))
        ended: list[Ending] = [(r, None) for r in self.requests.values()
                               if r.executor_id == ex.executor_id and r not in seqs]
        for req, group in seqs.items():
            error = self._refusal(req, group)
            if error is not False or (target is None and not left) or not movable:
                ended.append((req, error or None))
                continue
            req.executor_id = target.executor_id if target is not None else ex.executor_id
            stale += [s.seq_id for s in group if s.created]
            self._rewind(group, req.executor_id)
            moved += 1
            for s in group:  # waiting since the first loss (a restarted memory service, then this)
                self._lost[s] = _Lost(self._lost[s].since if s in self._lost else now, model)
        # Dropped with ex, as a rule; but a listing read just before a restarted memory service
        # registered ex again can arrive after sequences were admitted there: free them either way.
        self.free_stale(stale)
        if moved:
            log.warning("requests moved to another executor" if target is not None else
                        "requests waiting for an executor of their model", executor_id=clip(ex.executor_id),
                        to=clip(target.executor_id) if target is not None else None, requests=moved)
        return ended

    def tick(self) -> list[Ending]:
        """Rewound sequences whose executor is gone move to one of their model;
        those that waited too long end (returned with their error)."""
        now = time.monotonic()
        ended: dict[Request, KvpagerError] = {}
        for seq, lost in list(self._lost.items()):
            if self.sequences.get(seq.seq_id) is not seq or seq.created:
                del self._lost[seq]  # ended, or admitted again
                continue
            req = seq.request
            if req in ended:
                continue
            if now - lost.since > self.config.timeout_s:
                ended[req] = Unavailable(failures.RECOVERY_TIMEOUT, retry_after_s=1.0)
                continue
            ex = self.executors.get(seq.executor_id)
            if ex is not None and (lost.model is None or model_key(ex) == lost.model):
                continue
            target = self._target(lost.model)
            if target is not None:
                req.executor_id = target.executor_id
                for s in self.sequences.of_request(req):
                    s.executor_id = target.executor_id
        for req in ended:
            for s in self.sequences.of_request(req):
                self._lost.pop(s, None)
        return list(ended.items())

    # ---- shared -------------------------------------------------------------------------

    def _refusal(self, req: Request, seqs: list[Seq]) -> KvpagerError | None | bool:
        """False: ``req`` may go on; else the error it ends with (None: the
        loss's own, as without recovery)."""
        if any(s.retries >= self.config.max_retries for s in seqs if s.created):
            return Unavailable(failures.RETRIES_EXHAUSTED, retry_after_s=1.0)
        return False

    def _rewind(self, seqs: list[Seq], executor_id: str) -> list[int]:
        lost = [s for s in seqs if s.created]  # the others were never confirmed: no state was lost
        for s in lost:
            s.retries += 1
        metrics.SEQUENCES_READMITTED.inc(len(lost))
        old = self.sequences.readmit(seqs, executor_id)
        for req in {s.request for s in seqs if s.request.beam is not None}:
            req.beam.forget(old)  # their recompute gathers these candidates again
        return old

    def _target(self, model: ModelKey | None) -> ExecutorClient | None:
        alive = [ex for ex in self.executors.values() if ex.alive and (model is None or model_key(ex) == model)]
        return min(alive, key=lambda ex: self.sequences.load(ex.executor_id), default=None)

    @staticmethod
    def _by_request(seqs: Iterable[Seq]) -> dict[Request, list[Seq]]:
        out: dict[Request, list[Seq]] = {}
        for s in seqs:
            out.setdefault(s.request, []).append(s)
        return out

    def free_stale(self, seq_ids: list[int]) -> None:
        """Free ``seq_ids`` at the memory service, off the loop (best effort)."""
        if seq_ids:
            asyncio.get_running_loop().create_task(self._free_stale(seq_ids))

    async def _free_stale(self, seq_ids: list[int]) -> None:
        """Free the ids rewound sequences had (each on its own: an unknown id
        fails the call), retrying while the memory service is unreachable."""
        deadline = time.monotonic() + self.config.timeout_s
        delay = BACKOFF_FIRST_S
        todo = list(seq_ids)
        while todo:
            left = []
            for seq_id in todo:
                try:
                    await self.memory.free([seq_id], abort=True)
                except NotFound:
                    pass  # a restarted service never knew it, or it is freed already
                except Unavailable:
                    left.append(seq_id)
                except KvpagerError as exc:
                    log.info("freeing a rewound sequence", seq_id=seq_id, result=exc.status)
            todo = left
            if not todo:
                return
            if time.monotonic() > deadline:
                log.warning("rewound sequences not freed: the memory service stayed unreachable",
                            num_sequences=len(todo))
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)


