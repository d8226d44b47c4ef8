"""The engine loop: continuous batching over the memory service and executors.

One step = one memory-service ``Step`` (what changed since the last one:
forks, sampled tokens, finished and aborted sequences; and this step's
work, scheduled under a token budget with chunked prefill) + one
``Execute`` per executor in the plan, sent without waiting for the others +
stream what was sampled. Its parts: ``Executors`` (membership),
``RequestBook`` (requests in flight, aborts, endings), ``SequenceTable``
(the live sequences and their changes), ``Scheduler`` (policy and budget),
``ArrivalSettle`` (a step behind a prefill waits for arrivals), ``wire``
(message builders), ``RowBuilder`` (an executor's rows), ``BeamSearch``.
This module is one concept, the loop, and nothing else. All state is
mutated by the loop task alone; other coroutines post work (new requests,
aborts, executor changes) and wake it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

from kvpager.errors import Aborted, FailedPrecondition, KvpagerError, NotFound, Unavailable
from kvpager.prefix_index.hashing import PromptChain
from kvpager.seq_status import SeqStatus
from kvpager.log_limits import clip
from kvpager.telemetry import get_logger
from kvpager.v1 import common_pb2, executor_pb2, memory_pb2
from gateway import failures, metrics, wire
from gateway.arrivals import ArrivalSettle
from gateway.beam import BeamSearch
from gateway.bursts import fed_by_burst, may_cut
from gateway.clients import ExecutorClient, MemoryClient
from gateway.completions import Completions
from gateway.engine_config import EngineConfig
from gateway.failures import FailureLog, for_client
from gateway.inflight import Call, bursts_running, carry_into, next_burst_plan, take_returned
from gateway.membership import Executors
from gateway.outputs import Outbox
from gateway.recovery import Recovery
from gateway.rows import RowBuilder
from gateway.request_stats import RequestStats
from gateway.requests import RequestBook
from gateway.results import Results
from gateway.scheduling import Scheduler, make_policy
from gateway.sequences import SequenceTable
from gateway.state import Output, Request, Seq

log = get_logger("gateway.engine")


class Engine:
    def __init__(self, config: EngineConfig, memory: MemoryClient, tokenizer, *,
                 executor_tls=None, executor_token: str | None = None) -> None:
        self.config = config
        self.memory = memory
        self.tokenizer = tokenizer
        self._wake = asyncio.Event()
        self.executors = Executors(memory, max_n=config.max_n, max_prompt_tokens=config.max_prompt_tokens,
                                   tls=executor_tls, token=executor_token, on_join=self._wake.set,
                                   caps=config.caps, info_timeout_s=config.executor_info_timeout_s,
                                   stream_interval=config.stream_interval)
        self.scheduler = Scheduler(make_policy(config.policy), config.max_batch_tokens, config.max_running,
                                   config.num_scheduler_steps, config.max_burst_ms / 1e3)
        self.sequences = SequenceTable()
        self.outbox = Outbox()
        self.stats = RequestStats()
        self.requests = RequestBook(self.sequences, self.outbox, config.max_waiting, self.stats)
        self.completions = Completions(self.sequences, self.requests, self.outbox, self.executors)
        self.beams = BeamSearch(self.completions)
        self.results = Results(self.sequences, self.completions, self.beams, self.stats,
                               lambda: self.executors.limits.max_model_len)
        self.recovery = Recovery(config.recovery, self.sequences, self.requests, self.executors, memory)
        self._row_builder = RowBuilder(self.beams, plan_ahead=config.plan_ahead, stats=self.stats)
        self._step_id = int(time.time() * 1000) << 8  # increasing across gateway restarts
        self._refresh_now = asyncio.Event()
        self._failures = FailureLog()
        self._inflight: list[Call] = []  # oldest first
        self._parts = asyncio.Event()  # a streamed burst's sub-step came back
        self._depth = 2 if config.plan_ahead else 1  # Executes one executor may have in flight (one planned ahead)
        self.arrivals = ArrivalSettle(config.arrival_settle_ms / 1e3, config.max_batch_tokens, config.max_running)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.fenced = ""  # why another gateway took the memory service over ("" while this one drives it)
        metrics.FENCED.set(0)

    # views the router and servicer read
    @property
    def seqs(self) -> dict[int, Seq]:
        return self.sequences.seqs

    @property
    def limits(self):
        return self.executors.limits

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.executors.eos_ids

    @property
    def model_id(self) -> str:
        return self.executors.model_id

    @property
    def ready(self) -> bool:
        return self.executors.ready and not self.fenced

    def load(self, executor_id: str) -> int:
        return self.sequences.load(executor_id)

    # ---- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        try:
            self.executors.listed(await self.memory.list_executors())
            await self.executors.wait_joins()
            self._apply_executor_list()
        except KvpagerError as exc:
            log.warning("memory service not reachable yet", error=exc.message)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(), name="engine-loop"),
                       loop.create_task(self.executors.refresh(self.config.executor_refresh_s, self._refresh_now),
                                        name="executor-refresh")]

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for call in self._inflight:
            call.task.cancel()
        self._inflight = []
        self.requests.fail_all(Unavailable("gateway is shutting down"))
        self.outbox.flush()
        await self.executors.close()

    # ---- executors ------------------------------------------------------------

    def _apply_executor_list(self) -> None:
        for ex in self.executors.apply():
            self._lose_executor(ex, Unavailable("left or restarted"), deregister=False, left=True)

    def _lose_executor(self, ex: ExecutorClient, cause: KvpagerError, deregister: bool, left: bool = False) -> None:
        """A lost executor's requests move to another executor of its model
        (recompute, gateway/recovery.py); those that cannot end (UNAVAILABLE,
        or INTERNAL when it refused a step; ``cause`` goes to the log only).
        The memory service drops its sequences on deregistration or
        re-registration."""
        self.executors.remove(ex)
        error = for_client(cause, failures.EXECUTOR_LEFT if left else failures.EXECUTOR_FAILED)
        ended = self.recovery.executor_lost(ex, cause, left)
        for req, why in ended:
            self.requests.fail(req, why or error, release=False)
        loop = asyncio.get_running_loop()
        loop.create_task(self.executors.deregister(ex) if deregister else ex.close())
        self._failures.ended("executor lost", cause, [req.request_id for req, _ in ended],
                             executor_id=clip(ex.executor_id), status=cause.status)

    # ---- requests ---------------------------------------------------------------

    def new_request(self, request_id: str, prompt_ids: list[int], spec, *, seed: int | None, priority: int,
                    cache_salt: str, deadline: float | None, skip_special_tokens: bool,
                    chain: PromptChain | None = None, arrival_s: float | None = None, owner: str = "") -> Request:
        return self.requests.new(request_id, prompt_ids, spec, seed=seed, priority=priority, cache_salt=cache_salt,
                                 deadline=deadline, skip_special_tokens=skip_special_tokens, chain=chain,
                                 arrival_s=arrival_s, owner=owner)

    async def submit(self, req: Request, executor_id: str) -> None:
        """Admit a validated request to the loop (it is allocated nothing yet)."""
        if self.fenced:  # it passed the ready check before the fence
            raise Unavailable(failures.FENCED, retry_after_s=1.0)
        seq = self.requests.admit(req, executor_id, self.tokenizer)
        if req.spec.beam_width > 1:
            self.beams.start(req, seq)
        self.arrivals.admitted(time.perf_counter())
        self._wake.set()

    async def stream(self, req: Request) -> AsyncIterator[Output]:
        while True:
            item = await req.outputs.get()
            if item is Outbox.END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def abort(self, request_id: str, owner: str = "", error: KvpagerError | None = None) -> bool:
        """Cancel ``owner``'s request ``request_id``; its blocks are released in
        the next step. False when the owner has no such request (another
        owner's is not found either)."""
        if not self.requests.abort((owner, request_id), error):
            return False
        self._wake.set()
        return True

    # ---- the loop ---------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self.sequences.seqs or self.sequences.changes or self.requests.aborts_pending
                    or self.executors.has_updates)

    async def _run(self) -> None:
        """Executors are not stepped in lockstep: each Step plans for the
        executors that are idle, their Executes go out, and the loop plans
        again as soon as any executor is back (or new work arrives for an idle
        one), so a slow executor does not hold up the others. Step ids stay
        increasing at the memory service (one Step at a time) and at each
        executor (one Execute at a time per executor)."""
        while not self._stopping:
            if self.executors.memory_step_id > self._step_id and not self.fenced:  # replaced while idle
                await self._fence(Aborted("the memory service's last step is ahead of ours: another gateway drives it"))
            if not self._has_work() and not self._inflight:
                self.stats.queue((), time.perf_counter(), force=True)
                self.outbox.flush()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step()
                if self._depth > 1 and self._inflight and self._has_work():
                    await self._step()  # the next step of an executor now running one: planned ahead
                if self._inflight:
                    await self._collect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must survive anything one step does
                if not isinstance(exc, KvpagerError):
                    log.exception("engine step failed")
                await self._reset(exc, for_client(exc, failures.MEMORY_UNAVAILABLE), "engine step failed")
                self.outbox.flush()
            self.stats.queue(self.sequences.seqs.values(), time.perf_counter())
            await asyncio.sleep(0)  # let new requests run between steps

    async def _step(self) -> None:
        if self.executors.has_updates:
            self._apply_executor_list()
        self.requests.apply_aborts(asyncio.get_running_loop().time())
        if self.recovery.pending:
            for req, error in self.recovery.tick():
                self.requests.fail(req, error, release=False)
        self._wake.clear()  # what arrives from here on wakes the next round (see _collect)
        t0 = time.perf_counter()
        running: dict[str, int] = {}
        for call in self._inflight:
            running[call.ex.executor_id] = running.get(call.ex.executor_id, 0) + 1
        idle = [eid for eid in self.executors if running.get(eid, 0) < self._depth]
        # Behind a running prefill, while requests still arrive, a step waits for them (gateway.arrivals).
        batch = self.arrivals.schedule(
            self.scheduler, self.sequences, idle, self.executors.limits.max_model_len,
            bursts_running(self._inflight, t0, self.scheduler.clock, self._lead_s),
            self._inflight if self._depth > 1 else [], t0)
        # Sampled tokens alone ride with the next plan while Executes run (a Step would take cores from the forward).
        if not batch and (not self.sequences.changes or (self._inflight and self.sequences.changes.only_appends())):
            self.outbox.flush()
            if self.sequences.seqs and not self._inflight:
                await asyncio.sleep(0.005)  # nothing fits now (waiting for executors)
            return
        if not batch:
            self.outbox.flush()  # this Step only carries changes (nothing to execute): stream first
        self._step_id += 1
        changes = self.sequences.take_changes()
        # Decodes fed with a token still being sampled: placeholders at the memory service.
        pending = [s for s, fed in zip(batch.seqs, batch.fed) if fed]
        for s in pending:
            s.placeholders += 1
        metrics.ROWS_FED_AHEAD.inc(len(pending))
        request = wire.step_request(self._step_id, changes, batch, self.executors.clients,
                                    [s.seq_id for s in pending])
        metrics.TOKENS_SAMPLED_AHEAD.inc(sum(batch.lookahead))
        try:
            plan = await self.memory.step(request, self.config.step_timeout_s)
        except Aborted as exc:
            await self._fence(exc)
            return
        except (Unavailable, NotFound, FailedPrecondition) as exc:
            # Down, or it no longer holds what we think it does: it restarted (and
            # recovered, or not, from the mirror) or an executor was dropped and is
            # re-registering. Every sequence is admitted again once it is back.
            await self._memory_lost(exc, [*changes.free, *changes.abort], {s.seq_id for s in batch.new})
            return
        for seq in batch.new:
            seq.created = True
        self.recovery.step_ok(batch.new)
        t_plan = time.perf_counter()
        preempted = self._apply_outcomes(plan)
        for ep in plan.executor_plans:
            ex = self.executors.get(ep.executor_id)
            if ex is None or not ex.alive or not wire.has_work(ep):
                continue
            rows = self._rows(ep)
            # The step running on this executor, whose samples fill this one's placeholders (a burst: cut short).
            prev = next((c for c in reversed(self._inflight) if c.ex is ex), None)
            cut = prev is not None and self.config.cut_bursts and may_cut(prev.rows, rows, preempted)
            metrics.STEPS_BEHIND_BURST.inc(prev is not None and fed_by_burst(prev.rows, rows))
            request = wire.execute_request(self._step_id, ex.incarnation, ep, rows, prev.step_id if prev else 0, cut)
            parts: list = []  # its clients get each sub-step's tokens as it ends (streamed) or with the whole
            on_part = functools.partial(self._part_came, parts) if ep.executor_id in batch.streamed else None
            task = asyncio.ensure_future(ex.execute(request, self.config.step_timeout_s, on_part))
            sent = time.perf_counter()  # a step queued behind another starts when that one returns (_collect)
            self._inflight.append(Call(ex, task, rows, sent, t0, self._step_id, parts, None if prev else sent))
        self.outbox.flush()  # the Execute calls go out first; the streams run during the forward
        metrics.STEP_SECONDS.labels("plan").observe(t_plan - t0)
        metrics.SCHEDULED_SEQS.observe(len(batch.seqs))

    def _apply_outcomes(self, plan: memory_pb2.StepPlan) -> set[int]:
        """Rejections and preemptions applied; returns the preempted ids."""
        preempted = set()
        for rej in wire.rejections(plan):
            seq = self.sequences.get(rej.seq_id)
            if seq is not None:
                seq.created = False
                self.requests.fail(seq.request, rej.error)
        for seq_id, swapped in wire.preemptions(plan):
            preempted.add(seq_id)
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue
            seq.feed_ahead = False  # it runs again once its tokens are all known
            if swapped:
                seq.status = SeqStatus.SWAPPED
            else:
                seq.status = SeqStatus.WAITING
                seq.num_computed = 0
        return preempted

    def _rows(self, ep: common_pb2.ExecutorPlan) -> list[wire.Row]:
        return self._row_builder.rows(ep, self.sequences.seqs, max_model_len=self.executors.limits.max_model_len,
                                      eos_ids=self.eos_ids)

    def _part_came(self, parts: list, msg: executor_pb2.ExecuteResponse) -> None:
        parts.append(msg)
        self._parts.set()

    @property
    def _lead_s(self) -> float:
        """How long before a burst's end its next step is planned (gateway.inflight); 0: after."""
        return self.config.burst_plan_lead_ms / 1e3 if self._depth > 1 else 0.0

    async def _collect(self) -> None:
        """Wait until an Execute returns (or new work wakes the loop: an idle
        executor may take it now, or a burst nears its end: its next step is
        planned), taking a streamed burst's sub-steps as they come; then apply
        every finished one in order."""
        plan_at = self.arrivals.wake_at(next_burst_plan(self._inflight, time.perf_counter(), self.scheduler.clock,
                                                        self._lead_s))
        while not any(call.task.done() for call in self._inflight) and not self._wake.is_set():
            now = time.perf_counter()
            if plan_at and now >= plan_at:
                return  # the loop plans the burst's next step
            if not self._parts.is_set():
                wakers = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self._parts.wait())]
                try:
                    await asyncio.wait([*wakers, *(call.task for call in self._inflight)],
                                       timeout=plan_at - now if plan_at else None, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waker in wakers:
                        waker.cancel()
            self._take_parts()
        done, self._inflight = take_returned(self._inflight, time.perf_counter())  # each executor's in step order
        for i, call in enumerate(done):
            metrics.STEP_SECONDS.labels("execute").observe(time.perf_counter() - call.sent)
            self._finish_execute(call, done[i + 1:])  # sub-steps not taken yet are in the whole response
            metrics.STEP_SECONDS.labels("total").observe(time.perf_counter() - call.step_start)
        finished = {call.ex.executor_id for call in done}
        # Executors already running the step planned ahead: stream now, not after the next plan's round trip.
        self._take_parts(flush=bool(finished) and finished <= {call.ex.executor_id for call in self._inflight})

    def _take_parts(self, flush: bool = False) -> None:
        self._parts.clear()
        if self.results.take_parts(self._inflight, self.executors.get) or flush:
            self.outbox.flush()  # streamed at once

    def _finish_execute(self, call: Call, later: list[Call]) -> None:
        """``later``: the calls back after it (a cut burst's carried rows go to one: ``carry_into``)."""
        ex, task = call.ex, call.task
        if task.cancelled():
            return
        exc = task.exception()
        if self.executors.get(ex.executor_id) is not ex:
            return  # lost (or replaced) while the call ran: its requests have moved or ended already
        if exc is not None:
            self._lose_executor(ex, exc if isinstance(exc, KvpagerError) else Unavailable(repr(exc)),
                                deregister=True)
            return
        out = task.result()
        self.scheduler.clock.observe(ex.executor_id, call.rows, out.forward_s, out.sample_s, out.sub_steps_run,
                                     call.ran_for(time.perf_counter()))
        carried = self.results.whole(call.rows, out)
        if carried and not carry_into([*later, *self._inflight], ex, carried):
            self._lose_executor(ex, Unavailable("a burst's next sub-step went to a step not in flight"), True)

    async def _drain(self) -> None:
        """Until the Executes in flight are back (their samples are real tokens)."""
        while self._inflight:
            await asyncio.wait([call.task for call in self._inflight])
            await self._collect()

    async def _memory_lost(self, cause: KvpagerError, stale: list[int], sent_new: set[int]) -> None:
        """The Executes in flight finish first, then every sequence is rewound
        for re-admission (gateway/recovery.py); the next Step waits a backoff."""
        await self._drain()
        for req, error in self.recovery.memory_lost(cause, stale, sent_new):
            self.requests.fail(req, error or for_client(cause, failures.MEMORY_UNAVAILABLE), release=False)
        self._refresh_now.set()  # re-read the executors now (off the loop)
        self.outbox.flush()
        await asyncio.sleep(self.recovery.backoff_s())

    async def _fence(self, cause: Aborted) -> None:
        """The memory service's last step is ahead of ours: a newer gateway drives
        it (step ids start from the clock). Two writers would undo each other's
        state, so this one stops until restarted: Executes in flight finish,
        requests end UNAVAILABLE saying why, their sequences are freed."""
        await self._drain()
        self.fenced = cause.message
        metrics.FENCED.set(1)
        log.error("fenced: another gateway drives the memory service; serving stops", error=clip(cause.message, 400))
        await self._reset(cause, Unavailable(failures.FENCED, retry_after_s=1.0), "fenced")

    async def _reset(self, cause: Exception, error: KvpagerError, kind: str) -> None:
        """A step failed as a whole (a bug, or a refusal no retry helps): end
        every request with ``error`` (``cause`` goes to the log only) and free
        what the memory service holds, off the loop (best effort)."""
        created = [s.seq_id for s in self.sequences if s.created]
        self._failures.ended(kind, cause, [r.request_id for r in self.requests.values()],
                             status=getattr(cause, "status", "INTERNAL"))
        self.requests.fail_all(error, release=False)
        self.sequences.clear()
        self.recovery.free_stale(created)
