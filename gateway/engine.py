"""The engine loop: continuous batching over the memory service and executors.

One step = one memory-service `Step` (last step's results in: forks, sampled
tokens, finished and aborted sequences; this step's needs out: what to
compute, under a token budget, with chunked prefill) + one `Execute` per
executor with sequences in the plan (run concurrently) + stream what was
sampled. All state below is mutated only by the loop task; other coroutines
post work (new requests, aborts, executor changes) and wake it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvpager.errors import (DeadlineExceeded, FailedPrecondition, Internal, KvpagerError, NotFound,
                            ResourceExhausted, Unavailable,
                            error_for_status)
from kvpager.prefix_index.hashing import PromptChain, pack_hashes
from kvpager.packed import array_bytes, pack_i32, pack_i64, unpack_f32, unpack_i32, unpack_i64
from kvpager.telemetry import get_logger
from kvpager.v1 import common_pb2, executor_pb2, memory_pb2
from gateway import metrics
from gateway.beam import BeamSearch
from gateway.clients import ExecutorClient, MemoryClient
from gateway.outputs import accept_token, take_output
from gateway.params import Limits
from gateway.state import Completion, Finish, Output, Request, Seq, SeqStatus

log = get_logger("gateway.engine")

_END = None  # sentinel on a request's queue: the stream is over
# Seeds travel as int64: a client's uint64 seed (+ completion index) is taken
# modulo 2**63 (an unmasked 2**63 overflowed the step and failed every request).
SEED_MASK = (1 << 63) - 1


@dataclass
class EngineConfig:
    max_batch_tokens: int = 512      # tokens each executor computes per step (prefill chunks + decodes)
    max_running: int = 64            # sequences each executor runs per step
    max_waiting: int = 1024          # requests admitted but not finished
    max_n: int = 8
    policy: str = "fcfs"             # "fcfs" | "priority"
    step_timeout_s: float = 120.0
    executor_refresh_s: float = 2.0
    load_weight_tokens: float = 16.0  # routing: one queued sequence costs this many prefix tokens
    max_prompt_tokens: int = 0       # longest prompt accepted; 0 = max_model_len - 1


class Engine:
    def __init__(self, config: EngineConfig, memory: MemoryClient, tokenizer, *,
                 executor_tls=None, executor_token: str | None = None) -> None:
        self.config = config
        self._executor_tls = executor_tls      # ClientTls for Execute channels (None = insecure)
        self._executor_token = executor_token  # the admin token executors require
        self.memory = memory
        self.tokenizer = tokenizer
        self.executors: dict[str, ExecutorClient] = {}
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Seq] = {}
        self.limits: Limits | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.model_id = ""
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._step_id = int(time.time() * 1000) << 8  # increasing across gateway restarts
        self._forks: list[memory_pb2.ForkOp] = []
        self._appends: dict[int, int] = {}
        self._to_free: list[int] = []
        self._to_abort: list[int] = []
        self._aborts: dict[str, KvpagerError | None] = {}
        self._executor_updates: list[memory_pb2.ExecutorPoolInfo] | None = None
        # Stream items (outputs, end markers, errors) not yet handed to their
        # requests' queues: a step's tokens are released once the next step's
        # Execute is on its way, so the streams run while the executor computes.
        self._outbox: list[tuple[asyncio.Queue, object]] = []
        # Execute calls on their way, oldest first: (executor, task, plan rows, send time, step
        # start). An executor with one in flight is busy; the others join the next Step meanwhile.
        self._inflight: list[tuple[ExecutorClient, asyncio.Task, list, float, float]] = []
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self.beams = BeamSearch(self)

    # ---- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._apply_executor_list(await self.memory.list_executors())
        except KvpagerError as exc:
            log.warning("memory service not reachable yet", error=exc.message)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(), name="engine-loop"),
                       loop.create_task(self._refresh(), name="executor-refresh")]

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for _, task, *_ in self._inflight:
            task.cancel()
        self._inflight = []
        for req in list(self.requests.values()):
            self._fail_request(req, Unavailable("gateway is shutting down"))
        self._flush_outbox()
        for ex in self.executors.values():
            await ex.close()

    @property
    def ready(self) -> bool:
        return self.limits is not None and any(e.alive for e in self.executors.values())

    # ---- executors ------------------------------------------------------------

    async def _refresh(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.config.executor_refresh_s)
            try:
                self._executor_updates = await self.memory.list_executors()
                self._wake.set()
            except KvpagerError as exc:
                log.warning("executor refresh failed", error=exc.message)

    async def _apply_executor_list(self, pools: list[memory_pb2.ExecutorPoolInfo]) -> None:
        listed = {p.executor_id: p for p in pools}
        for executor_id, ex in list(self.executors.items()):
            pool = listed.get(executor_id)
            if pool is None or pool.incarnation != ex.incarnation or pool.address != ex.address:
                self._lose_executor(ex, Unavailable(f"executor {executor_id} left or restarted"), deregister=False)
        for executor_id, pool in listed.items():
            if executor_id in self.executors or not pool.address:
                continue
            ex = ExecutorClient(pool, tls=self._executor_tls, token=self._executor_token)
            try:
                info = await ex.load_info()
            except KvpagerError as exc:
                log.warning("executor unreachable", executor_id=executor_id, error=exc.message)
                await ex.close()
                continue
            self.executors[executor_id] = ex
            self._set_limits(info)
            log.info("executor joined", executor_id=executor_id, address=pool.address, model=info.model_id)

    def _set_limits(self, info: executor_pb2.ExecutorInfo) -> None:
        alive = [e.info for e in self.executors.values() if e.alive and e.info is not None]
        max_len = min(i.max_model_len for i in alive)
        self.limits = Limits(max_model_len=max_len, vocab_size=info.vocab_size, max_n=self.config.max_n,
                             max_prompt_tokens=self.config.max_prompt_tokens)
        self.eos_ids = frozenset(info.eos_token_ids)
        self.model_id = info.model_id

    def _lose_executor(self, ex: ExecutorClient, error: KvpagerError, deregister: bool) -> None:
        """Every request on a lost executor ends with `error`; its sequences are
        forgotten here (the memory service drops them on deregistration or
        re-registration)."""
        ex.alive = False
        self.executors.pop(ex.executor_id, None)
        for req in [r for r in self.requests.values() if r.executor_id == ex.executor_id]:
            self._fail_request(req, error, release=False)
        for seq_id in [s for s, seq in self.seqs.items() if seq.executor_id == ex.executor_id]:
            self._forget(seq_id)
        if deregister:
            asyncio.get_running_loop().create_task(self._deregister(ex))
        else:
            asyncio.get_running_loop().create_task(ex.close())
        log.warning("executor lost", executor_id=ex.executor_id, error=error.message)

    async def _deregister(self, ex: ExecutorClient) -> None:
        try:
            await self.memory.deregister(ex.executor_id, ex.incarnation)
        except KvpagerError as exc:  # already gone or re-registered: its blocks are released either way
            log.info("deregister after executor loss", executor_id=ex.executor_id, result=exc.status)
        await ex.close()

    # ---- requests ---------------------------------------------------------------

    def new_request(self, request_id: str, prompt_ids: list[int], spec, *, seed: int | None, priority: int,
                    cache_salt: str, deadline: float | None, skip_special_tokens: bool,
                    chain: PromptChain | None = None) -> Request:
        return Request(request_id, prompt_ids, spec, seed if seed is not None else random.getrandbits(62),
                       priority=priority, cache_salt=cache_salt, arrival=next(self._arrivals), deadline=deadline,
                       skip_special_tokens=skip_special_tokens,
                       chain=chain if chain is not None else PromptChain(prompt_ids, cache_salt))

    async def submit(self, req: Request, executor_id: str) -> None:
        """Admit a validated request to the loop (it is allocated nothing yet)."""
        if req.request_id in self.requests:
            raise error_for_status("ALREADY_EXISTS", f"request id {req.request_id!r} is in use")
        if len(self.requests) >= self.config.max_waiting:
            raise ResourceExhausted(f"{len(self.requests)} requests in flight; the limit is "
                                    f"{self.config.max_waiting}", retry_after_s=1.0)
        req.executor_id = executor_id
        from gateway.detokenizer import IncrementalDetokenizer

        n = req.spec.num_completions
        req.completions = [Completion(i, IncrementalDetokenizer(self.tokenizer, req.prompt_ids,
                                                                req.skip_special_tokens)) for i in range(n)]
        seq = Seq(next(self._seq_ids), req, None if req.spec.beam_width > 1 else req.completions[0],
                  list(req.prompt_ids), executor_id)
        if req.spec.beam_width > 1:
            self.beams.start(req, seq)
        self.requests[req.request_id] = req
        self.seqs[seq.seq_id] = seq
        metrics.REQUESTS_RUNNING.set(len(self.requests))
        self._wake.set()

    async def stream(self, req: Request) -> AsyncIterator[Output]:
        while True:
            item = await req.outputs.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def abort(self, request_id: str, error: KvpagerError | None = None) -> bool:
        """Cancel a request; its blocks are released in the next step."""
        if request_id not in self.requests:
            return False
        self._aborts[request_id] = error
        self._wake.set()
        return True

    def load(self, executor_id: str) -> int:
        return sum(1 for s in self.seqs.values() if s.executor_id == executor_id)

    # ---- the loop ---------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self.seqs or self._to_free or self._to_abort or self._forks or self._aborts
                    or self._executor_updates is not None)

    async def _run(self) -> None:
        """Executors are not stepped in lockstep: each Step plans for the
        executors that are idle, their Executes go out, and the loop plans
        again as soon as any executor is back (or new work arrives for an idle
        one), so a slow executor does not hold up the others. Step ids stay
        increasing at the memory service (one Step at a time) and at each
        executor (one Execute at a time per executor)."""
        while not self._stopping:
            if not self._has_work() and not self._inflight:
                self._flush_outbox()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step()
                if self._inflight:
                    await self._collect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the loop must survive anything one step does
                log.exception("engine step failed")
                err = exc if isinstance(exc, KvpagerError) else Internal("engine step failed")
                await self._reset(err)
                self._flush_outbox()
            await asyncio.sleep(0)  # let new requests run between steps

    async def _collect(self) -> None:
        """Wait until an Execute returns (or new work wakes the loop: an idle
        executor may take it now), then apply every finished one in order."""
        if not any(task.done() for _, task, *_ in self._inflight) and not self._wake.is_set():
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait([waker, *(task for _, task, *_ in self._inflight)],
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waker.cancel()
        pending, blocked = [], set()
        for entry in self._inflight:
            ex, task, rows, t_sent, t_step = entry
            if not task.done() or ex.executor_id in blocked:
                pending.append(entry)
                blocked.add(ex.executor_id)  # an executor's results are applied in step order
                continue
            metrics.STEP_SECONDS.labels("execute").observe(time.perf_counter() - t_sent)
            self._finish_execute(ex, rows, task)
            metrics.STEP_SECONDS.labels("total").observe(time.perf_counter() - t_step)
        self._inflight = pending

    def _finish_execute(self, ex: ExecutorClient, rows: list, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if self.executors.get(ex.executor_id) is not ex:
            return  # lost (or replaced) while the call ran: its requests have ended already
        exc = task.exception()
        if exc is not None:
            if isinstance(exc, KvpagerError) and not isinstance(exc, Unavailable):
                log.error("executor rejected a step", executor_id=ex.executor_id, error=exc.message)
            self._lose_executor(ex, exc if isinstance(exc, KvpagerError) else Unavailable(str(exc)),
                                deregister=True)
            return
        self._apply_results(rows, task.result())

    async def _reset(self, error: KvpagerError, release: bool | None = None) -> None:
        """A step failed as a whole: end every request, release what we can
        (best effort, one sequence at a time: some may be unknown by now)."""
        created = [s.seq_id for s in self.seqs.values() if s.created]
        for req in list(self.requests.values()):
            self._fail_request(req, error, release=False)
        self.seqs.clear()
        self._forks, self._appends, self._to_free, self._to_abort = [], {}, [], []
        if release is None:
            release = not isinstance(error, Unavailable)
        if created and release:
            for seq_id in created:
                try:
                    await self.memory.free([seq_id], abort=True)
                except KvpagerError:
                    pass

    def _apply_aborts(self) -> None:
        now = asyncio.get_running_loop().time()
        for req in self.requests.values():
            if req.deadline is not None and now > req.deadline and req.request_id not in self._aborts:
                self._aborts[req.request_id] = DeadlineExceeded("request deadline passed")
        aborts, self._aborts = self._aborts, {}
        for request_id, error in aborts.items():
            req = self.requests.get(request_id)
            if req is None:
                continue
            if error is None:
                for comp in req.completions:
                    if comp.finish is Finish.NONE:
                        comp.finish = Finish.ABORT
                        out = take_output(req, comp)
                        if out is not None:
                            self._emit(req, out)
                self._end_request(req, abort=True)
            else:
                self._fail_request(req, error)
            metrics.ABORTS.inc()

    async def _step(self) -> None:
        if self._executor_updates is not None:
            updates, self._executor_updates = self._executor_updates, None
            await self._apply_executor_list(updates)
        self._apply_aborts()
        self._wake.clear()  # what arrives from here on wakes the next round (see _collect)
        t0 = time.perf_counter()
        busy = {ex.executor_id for ex, *_ in self._inflight}
        sched_ids, sched_n, new_seqs = self._schedule(busy)
        if not (sched_ids or self._forks or self._appends or self._to_free or self._to_abort):
            self._flush_outbox()
            if self.seqs and not self._inflight:
                await asyncio.sleep(0.005)  # nothing fits now (waiting for executors)
            return
        self._step_id += 1
        app = list(self._appends)
        request = memory_pb2.StepRequest(
            step_id=self._step_id, forks=self._forks,
            appended=common_pb2.TokenBatch(seq_ids=pack_i64(app), offsets=pack_i32(range(len(app) + 1)),
                                           token_ids=pack_i32(self._appends[s] for s in app)) if app else None,
            free_seq_ids=pack_i64(self._to_free), abort_seq_ids=pack_i64(self._to_abort),
            new_sequences=new_seqs, schedule_seq_ids=pack_i64(sched_ids), schedule_num_tokens=pack_i32(sched_n))
        try:
            plan = await self.memory.step(request, self.config.step_timeout_s)
        except Unavailable as exc:
            await self._reset(Unavailable(f"memory service unavailable: {exc.message}"))
            self._flush_outbox()
            return
        except (NotFound, FailedPrecondition) as exc:
            # The memory service no longer holds what we think it does: it restarted (and
            # recovered, or not, from the mirror) or an executor was dropped and is
            # re-registering. Retryable for clients; re-read the executors before routing again.
            log.warning("memory service state diverged from the gateway's; resetting", error=exc.message)
            await self._reset(Unavailable(f"serving state was reset ({exc.message}); retry"), release=True)
            try:
                await self._apply_executor_list(await self.memory.list_executors())
            except KvpagerError:
                pass
            self._flush_outbox()
            return
        self._forks, self._appends, self._to_free, self._to_abort = [], {}, [], []
        for new in new_seqs:
            if new.seq_id in self.seqs:
                self.seqs[new.seq_id].created = True
        t_plan = time.perf_counter()
        self._apply_plan_outcomes(plan)
        for ep in plan.executor_plans:
            ex = self.executors.get(ep.executor_id)
            if ex is None or not ex.alive:
                continue
            exec_req, rows = self._execute_request(ep)
            ops = ep.cache_ops
            if rows or ops.copy_src or ops.swap_out_src or ops.swap_in_src:
                # a plan with only cache ops (a swap-out of a preempted sequence) must still run
                task = asyncio.ensure_future(ex.execute(exec_req, self.config.step_timeout_s))
                self._inflight.append((ex, task, rows, time.perf_counter(), t0))
        self._flush_outbox()  # the Execute calls go out first; the streams run during the forward
        metrics.STEP_SECONDS.labels("plan").observe(t_plan - t0)
        metrics.SCHEDULED_SEQS.observe(len(sched_ids))

    def _schedule(self, busy: set[str] = frozenset()) -> tuple[list[int], list[int], list[memory_pb2.NewSequence]]:
        """What to ask the memory service to compute, in priority order, on
        the executors not busy with an earlier step."""
        cfg = self.config
        alive = {eid: ex for eid, ex in self.executors.items() if eid not in busy}
        if cfg.policy == "priority":
            def key(s: Seq):
                return (s.request.priority, s.request.arrival, s.seq_id)
        else:  # FCFS: sequences already holding KV first, then by arrival
            def key(s: Seq):
                return (s.status is SeqStatus.WAITING, s.request.arrival, s.seq_id)
        # Each executor runs its own forward: the token budget and the sequence cap are per
        # executor and step (one shared budget starved the others behind a long prefill).
        budget = dict.fromkeys(alive, cfg.max_batch_tokens)
        running = dict.fromkeys(alive, 0)
        open_executors = len(alive)
        ids, nums, new = [], [], []
        for s in sorted(self.seqs.values(), key=key):
            if open_executors == 0:
                break
            eid = s.executor_id
            if eid not in alive or budget[eid] <= 0:
                continue
            remaining = len(s.tokens) - s.num_computed
            if remaining <= 0:
                continue
            k = min(remaining, budget[eid])
            budget[eid] -= k
            running[eid] += 1
            if budget[eid] <= 0 or running[eid] >= cfg.max_running:
                budget[eid] = 0
                open_executors -= 1
            ids.append(s.seq_id)
            nums.append(k)
            if not s.created:
                req = s.request
                ex = alive[eid]
                new.append(memory_pb2.NewSequence(
                    seq_id=s.seq_id, executor_id=s.executor_id, prompt_token_ids=pack_i32(s.tokens),
                    priority=req.priority, cache_salt=req.cache_salt,
                    max_total_tokens=len(req.prompt_ids) + req.spec.max_tokens,
                    prompt_block_hashes=pack_hashes(req.chain.hashes(ex.namespace, ex.block_size))
                    if len(s.tokens) == len(req.prompt_ids) else b""))
        return ids, nums, new

    def _apply_plan_outcomes(self, plan: memory_pb2.StepPlan) -> None:
        for rej in plan.rejected:
            seq = self.seqs.get(rej.seq_id)
            if seq is not None:
                seq.created = False
                self._fail_request(seq.request, error_for_status(rej.code, rej.message))
        for p in plan.preempted:
            seq = self.seqs.get(p.seq_id)
            if seq is None:
                continue
            if p.mode == common_pb2.PREEMPTION_MODE_SWAP:
                seq.status = SeqStatus.SWAPPED
            else:
                seq.status = SeqStatus.WAITING
                seq.num_computed = 0
            metrics.PREEMPTIONS.labels("swap" if p.mode == common_pb2.PREEMPTION_MODE_SWAP else "recompute").inc()

    def _execute_request(self, ep: memory_pb2.ExecutorPlan) -> tuple[executor_pb2.ExecuteRequest, list]:
        """The executor's part of the plan, with token ids and sampling added.
        Block tables and slot mappings pass through as the memory service packed them."""
        seq_ids = unpack_i64(ep.seq_ids)
        ctx = unpack_i32(ep.context_lens)
        qlen = unpack_i32(ep.query_lens)
        cached = unpack_i32(ep.num_cached_tokens)
        tokens = array("i")
        num_samples, temps, top_ps, top_ks, seeds, tops = (array("i"), array("f"), array("f"), array("i"),
                                                            array("q"), array("i"))
        rows = []  # (seq, num_samples, num_top) per plan row
        want_logprobs = False
        for i, seq_id in enumerate(seq_ids):
            seq = self.seqs[seq_id]
            req = seq.request
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = cached[i] if i < len(cached) else 0
            start, n = ctx[i], qlen[i]
            seq.status = SeqStatus.RUNNING
            seq.num_computed = start + n
            tokens.extend(seq.tokens[start:start + n])
            spec = req.spec
            samples, top = 0, 0
            if seq.num_computed == len(seq.tokens):  # the last known token: its logits are wanted
                if spec.beam_width > 1:
                    top = self.beams.top_k(req)
                elif spec.n > 1 and not seq.sampled_first:
                    samples = spec.n
                    seeds.extend((req.seed + j) & SEED_MASK for j in range(samples))
                else:
                    samples = 1
                    seeds.append((req.seed + seq.completion.index) & SEED_MASK)
            num_samples.append(samples)
            temps.append(spec.temperature)
            top_ps.append(spec.top_p)
            top_ks.append(spec.top_k)
            tops.append(top)
            want_logprobs = want_logprobs or spec.logprobs
            rows.append((seq, samples, top))
        ex = self.executors[ep.executor_id]
        request = executor_pb2.ExecuteRequest(
            step_id=self._step_id, incarnation=ex.incarnation, cache_ops=ep.cache_ops, seq_ids=ep.seq_ids,
            context_lens=ep.context_lens, query_lens=ep.query_lens, token_ids=array_bytes(tokens),
            block_table_offsets=ep.block_table_offsets, block_tables=ep.block_tables, slot_mapping=ep.slot_mapping,
            sampling=executor_pb2.SamplingBatch(
                num_samples=array_bytes(num_samples), temperature=array_bytes(temps), top_p=array_bytes(top_ps),
                top_k=array_bytes(top_ks), seeds=array_bytes(seeds), num_top_logprobs=array_bytes(tops),
                return_logprobs=want_logprobs))
        return request, rows

    def _apply_results(self, rows: list, resp: executor_pb2.ExecuteResponse) -> None:
        sampled = unpack_i32(resp.sampled_token_ids)
        logprobs = unpack_f32(resp.sampled_logprobs) if resp.sampled_logprobs else None
        top_offsets = unpack_i32(resp.top_offsets) if resp.top_offsets else None
        top_ids = unpack_i32(resp.top_token_ids) if resp.top_token_ids else None
        top_lps = unpack_f32(resp.top_logprobs) if resp.top_logprobs else None
        pos = 0
        for row, (seq, samples, top) in enumerate(rows):
            if top:
                a, b = top_offsets[row], top_offsets[row + 1]
                self.beams.candidates(seq, list(top_ids[a:b]), list(top_lps[a:b]))
                continue
            if not samples:
                continue
            toks = sampled[pos:pos + samples]
            lps = logprobs[pos:pos + samples] if logprobs is not None else [None] * samples
            pos += samples
            if seq.seq_id not in self.seqs:
                continue  # aborted while the step ran
            try:
                if samples > 1:
                    self._fan_out(seq, list(toks), list(lps))
                else:
                    self._accept(seq, seq.completion, toks[0], lps[0])
            except Exception:  # one request's bug must not end the others' streams
                self.fail_on_bug(seq.request, "taking its sampled tokens")
        self.beams.finish_step()
        metrics.TOKENS_GENERATED.inc(len(sampled))

    def fail_on_bug(self, req: Request, doing: str) -> None:
        """End one request with INTERNAL (its blocks freed next step) after an
        unexpected exception while processing it; the step goes on for the rest."""
        log.exception("request failed inside the engine", request_id=req.request_id, doing=doing)
        self._fail_request(req, Internal(f"internal error while {doing}; request {req.request_id} ended"))

    def _fan_out(self, parent: Seq, toks: list[int], lps: list) -> None:
        """n > 1: the prompt was computed once; each completion gets its own
        first token, children share the parent's blocks (copy-on-write)."""
        parent.sampled_first = True
        req = parent.request
        children = []
        for i in range(1, len(toks)):
            child = Seq(next(self._seq_ids), req, req.completions[i], list(parent.tokens), parent.executor_id,
                        num_computed=parent.num_computed, status=SeqStatus.RUNNING, created=True,
                        sampled_first=True)
            self.seqs[child.seq_id] = child
            children.append(child)
        self._forks.append(memory_pb2.ForkOp(parent_seq_id=parent.seq_id,
                                             child_seq_ids=[c.seq_id for c in children]))
        self._accept(parent, parent.completion, toks[0], lps[0])
        for child, tok, lp in zip(children, toks[1:], lps[1:]):
            self._accept(child, child.completion, tok, lp)

    def _accept(self, seq: Seq, comp: Completion, token: int, logprob) -> None:
        req = seq.request
        finish = accept_token(req, comp, token, logprob, self.eos_ids, len(seq.tokens) + 1,
                              self.limits.max_model_len)
        out = take_output(req, comp)
        if out is not None:
            self._emit(req, out)
        if finish is Finish.NONE:
            seq.tokens.append(token)
            self._appends[seq.seq_id] = token
            return
        self._release(seq)
        if all(c.finish is not Finish.NONE for c in req.completions):
            self._end_request(req)

    # ---- bookkeeping --------------------------------------------------------------

    def _emit(self, req: Request, item) -> None:
        """Queue a stream item for ``req`` (in order; delivered by ``_flush_outbox``)."""
        self._outbox.append((req.outputs, item))

    def _flush_outbox(self) -> None:
        outbox, self._outbox = self._outbox, []
        for queue, item in outbox:
            queue.put_nowait(item)

    def _release(self, seq: Seq, abort: bool = False) -> None:
        """Forget a sequence; the memory service frees it in the next step."""
        self._forget(seq.seq_id)
        if seq.created:
            (self._to_abort if abort else self._to_free).append(seq.seq_id)

    def _forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self._appends.pop(seq_id, None)

    def _end_request(self, req: Request, abort: bool = False) -> None:
        for seq in [s for s in self.seqs.values() if s.request is req]:
            self._release(seq, abort=abort)
        req.done = True
        self.requests.pop(req.request_id, None)
        self._emit(req, _END)
        metrics.REQUESTS_RUNNING.set(len(self.requests))
        metrics.REQUESTS_FINISHED.labels("abort" if abort else "ok").inc()

    def _fail_request(self, req: Request, error: KvpagerError, release: bool = True) -> None:
        if req.done:
            return
        if release:
            for seq in [s for s in self.seqs.values() if s.request is req]:
                self._release(seq, abort=True)
        else:
            for seq_id in [s.seq_id for s in self.seqs.values() if s.request is req]:
                self._forget(seq_id)
        req.done = True
        self.requests.pop(req.request_id, None)
        self._emit(req, error)
        metrics.REQUESTS_RUNNING.set(len(self.requests))
        metrics.REQUESTS_FINISHED.labels(error.status.lower()).inc()
