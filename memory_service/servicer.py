"""Thin gRPC servicer: proto -> domain records, delegate, domain -> proto.

Errors are domain exceptions; kvpager.server's interceptor maps them to
status codes. Nothing here decides anything.
"""

from __future__ import annotations

import asyncio
from array import array
import time

from kvpager.errors import InvalidArgument, ResourceExhausted
from kvpager.packed import array_bytes, unpack_i32, unpack_i64
from kvpager.prefix_index.hashing import DIGEST_BYTES, unpack_hashes
from kvpager.v1 import common_pb2, memory_pb2, memory_pb2_grpc
from memory_service.accounting import PoolAccounting
from memory_service.changes import CacheOpsBuilder, TableChanges
from memory_service.costs import ExecutorCosts
from memory_service.kv_manager import ExecutorSpec
from memory_service.policy import PreemptionMode
from memory_service.retention import MAX_RETENTION_S
from memory_service.records import NewSeq, RejectionReason, StepInput, StepOutput
from memory_service.service_state import MemoryState

_MODES = {PreemptionMode.RECOMPUTE: common_pb2.PREEMPTION_MODE_RECOMPUTE,
          PreemptionMode.SWAP: common_pb2.PREEMPTION_MODE_SWAP}
_REASONS = {RejectionReason.OVER_CONTEXT_LIMIT: common_pb2.REJECTION_REASON_OVER_CONTEXT_LIMIT,
            RejectionReason.OVER_POOL: common_pb2.REJECTION_REASON_OVER_POOL,
            RejectionReason.OVER_QUOTA: common_pb2.REJECTION_REASON_OVER_QUOTA}


MAX_TENANT_CHARS = 256


def spec_from_proto(info: memory_pb2.ExecutorPoolInfo) -> ExecutorSpec:
    return ExecutorSpec(
        executor_id=info.executor_id, num_blocks=info.num_blocks, block_size=info.block_size,
        num_swap_blocks=info.num_swap_blocks, address=info.address, model_id=info.model_id,
        dtype=info.dtype, incarnation=info.incarnation, pool_generation=info.pool_generation,
        max_model_len=info.max_model_len, vocab_size=info.vocab_size, adapter=info.adapter,
        kv_group_windows=tuple(info.kv_group_windows))


def costs_from_proto(msg: memory_pb2.ExecutorCosts) -> ExecutorCosts:
    """InvalidArgument for a malformed report (lengths, order, negative or non-finite figures)."""
    return ExecutorCosts(tuple(msg.prefill_batch_tokens), tuple(msg.prefill_tokens_per_s), msg.swap_bytes_per_s,
                         msg.block_bytes)


def costs_to_proto(c: ExecutorCosts) -> memory_pb2.ExecutorCosts:
    return memory_pb2.ExecutorCosts(prefill_batch_tokens=c.prefill_batch_tokens,
                                    prefill_tokens_per_s=c.prefill_tokens_per_s,
                                    swap_bytes_per_s=c.swap_bytes_per_s, block_bytes=c.block_bytes)


def spec_to_proto(spec: ExecutorSpec, costs: ExecutorCosts | None = None) -> memory_pb2.ExecutorPoolInfo:
    return memory_pb2.ExecutorPoolInfo(
        costs=costs_to_proto(costs) if costs is not None else None,
        executor_id=spec.executor_id, address=spec.address, num_blocks=spec.num_blocks,
        block_size=spec.block_size, num_swap_blocks=spec.num_swap_blocks, model_id=spec.model_id,
        dtype=spec.dtype, incarnation=spec.incarnation, pool_generation=spec.pool_generation,
        max_model_len=spec.max_model_len, vocab_size=spec.vocab_size, adapter=spec.adapter,
        kv_group_windows=spec.kv_group_windows)


def _hashes(data: bytes, field: str) -> list[bytes]:
    try:
        return unpack_hashes(data)
    except ValueError as exc:
        raise InvalidArgument(f"{field}: {exc}") from None


def step_from_proto(req: memory_pb2.StepRequest) -> StepInput:
    app = req.appended
    app_ids = unpack_i64(app.seq_ids, "appended.seq_ids")
    app_offsets = unpack_i32(app.offsets, "appended.offsets")
    app_tokens = unpack_i32(app.token_ids, "appended.token_ids")
    if not app_ids and (app_tokens or len(app_offsets) > 1):
        raise InvalidArgument("appended: tokens without seq_ids")
    for n in req.new_sequences:
        if len(n.tenant) > MAX_TENANT_CHARS:
            raise InvalidArgument(f"new_sequences.tenant must be at most {MAX_TENANT_CHARS} characters")
        if not 0.0 <= n.retention_s <= MAX_RETENTION_S:  # NaN fails too
            raise InvalidArgument(f"new_sequences.retention_s must be in [0, {MAX_RETENTION_S:g}] seconds")
    new = [NewSeq(n.seq_id, n.executor_id, unpack_i32(n.prompt_token_ids, "new_sequences.prompt_token_ids"),
                  n.priority, n.cache_salt, n.max_total_tokens,
                  _hashes(n.prompt_block_hashes, "new_sequences.prompt_block_hashes") if n.prompt_block_hashes
                  else None, n.request_id[:256], n.tenant, n.retention_s)
           for n in req.new_sequences]
    return StepInput(
        step_id=req.step_id,
        appended_seq_ids=app_ids, appended_offsets=app_offsets, appended_tokens=app_tokens,
        forks=[(f.parent_seq_id, list(f.child_seq_ids)) for f in req.forks],
        free_seq_ids=unpack_i64(req.free_seq_ids, "free_seq_ids"),
        abort_seq_ids=unpack_i64(req.abort_seq_ids, "abort_seq_ids"),
        new_seqs=new,
        schedule_seq_ids=unpack_i64(req.schedule_seq_ids, "schedule_seq_ids"),
        schedule_num_tokens=unpack_i32(req.schedule_num_tokens, "schedule_num_tokens"),
        pending_seq_ids=unpack_i64(req.pending_seq_ids, "pending_seq_ids"),
        schedule_lookahead=unpack_i32(req.schedule_lookahead, "schedule_lookahead"),
        cut_seq_ids=unpack_i64(req.cut_seq_ids, "cut_seq_ids"),
        carried_seq_ids=unpack_i64(req.carried_seq_ids, "carried_seq_ids"),
    )


def _ops_to_proto(ops: CacheOpsBuilder) -> common_pb2.CacheOps:
    def b(values: list[int]) -> bytes:
        return array_bytes(array("i", values)) if values else b""

    return common_pb2.CacheOps(copy_src=b(ops.copy_src), copy_dst=b(ops.copy_dst),
                               swap_out_src=b(ops.swap_out_src), swap_out_dst=b(ops.swap_out_dst),
                               swap_in_src=b(ops.swap_in_src), swap_in_dst=b(ops.swap_in_dst))


def _tables_to_proto(t: TableChanges) -> common_pb2.TableChanges:
    msg = common_pb2.TableChanges(forks=[common_pb2.ForkOp(parent_seq_id=p, child_seq_ids=c) for p, c in t.forks])
    if t.dropped:
        msg.dropped_seq_ids = array_bytes(t.dropped)
    if t.started_seq_ids:
        msg.started_seq_ids = array_bytes(t.started_seq_ids)
        msg.started_context_lens = array_bytes(t.started_context_lens)
        msg.started_offsets = array_bytes(t.started_offsets)
        msg.started_block_ids = array_bytes(t.started_block_ids)
    if t.extended_seq_ids:
        msg.extended_seq_ids = array_bytes(t.extended_seq_ids)
        msg.extended_first_index = array_bytes(t.extended_first_index)
        msg.extended_offsets = array_bytes(t.extended_offsets)
        msg.extended_block_ids = array_bytes(t.extended_block_ids)
    return msg


def plan_to_proto(out: StepOutput) -> memory_pb2.StepPlan:
    plan = memory_pb2.StepPlan(step_id=out.step_id)
    for p in out.executor_plans:
        ep = plan.executor_plans.add(executor_id=p.executor_id, incarnation=p.incarnation, table_epoch=p.table_epoch,
                                     seq_ids=array_bytes(p.seq_ids), query_lens=array_bytes(p.query_lens))
        if p.tables:
            ep.tables.CopyFrom(_tables_to_proto(p.tables))
            if p.tables.started_seq_ids:
                ep.started_cached_tokens = array_bytes(p.tables.started_cached_tokens)
        for t in p.group_tables:
            ep.group_tables.append(_tables_to_proto(t))
        if p.ops:
            ep.cache_ops.CopyFrom(_ops_to_proto(p.ops))
    for (seq_id, mode), d in zip(out.preempted, out.decisions):
        e = d.estimate
        plan.preempted.add(seq_id=seq_id, mode=_MODES[mode], reason=d.reason, recompute_tokens=e.recompute_tokens,
                           recompute_cost_s=-1.0 if e.recompute_s is None else e.recompute_s,
                           swap_bytes=e.swap_bytes, swap_cost_s=-1.0 if e.swap_total_s is None else e.swap_total_s)
    if out.unscheduled:
        plan.unscheduled_seq_ids = array_bytes(array("q", out.unscheduled))
    for r in out.rejected:
        plan.rejected.add(seq_id=r.seq_id, reason=_REASONS[r.reason], message=r.message)
    return plan


def accounting_to_proto(a: PoolAccounting) -> memory_pb2.PoolAccounting:
    d = a.as_dict()
    groups = [memory_pb2.KvGroupAccounting(**g) for g in d.pop("kv_groups")]
    return memory_pb2.PoolAccounting(**d, kv_groups=groups)


MAX_BLOCK_SIZE = 1024  # tokens; the executor's own limit


class MemoryServicer(memory_pb2_grpc.MemoryServiceServicer):
    """Sizes, names and the registry's room are the manager's limits
    (``memory_service.limits``); the watcher limits are checked here."""

    # Called by the gateway every step: its request id comes back in trailing metadata (kvpager.server).
    PER_STEP_METHODS = ("Step",)

    def __init__(self, state: MemoryState) -> None:
        self.state = state
        self.limits = state.manager.limits
        self._watchers = 0
        self._shared: memory_pb2.AccountingSnapshot | None = None  # what every watcher gets ...
        self._shared_at = 0.0                                      # ... computed then (monotonic)

    async def RegisterExecutor(self, request, context):
        info = request.info
        if info.block_size > MAX_BLOCK_SIZE:
            raise InvalidArgument(f"block_size must be <= {MAX_BLOCK_SIZE}")
        costs = costs_from_proto(info.costs) if info.HasField("costs") else None
        await self.state.until_recovered()  # bounded: recovery has its own time limit
        replaced = self.state.register_executor(spec_from_proto(info), costs)
        return memory_pb2.RegisterExecutorResponse(replaced_previous=replaced, lease_s=self.state.lease_s)

    async def DeregisterExecutor(self, request, context):
        dropped = self.state.deregister_executor(request.executor_id, request.incarnation)
        return memory_pb2.DeregisterExecutorResponse(sequences_dropped=dropped)

    async def Heartbeat(self, request, context):
        costs = costs_from_proto(request.costs) if request.HasField("costs") else None
        self.state.heartbeat(request.executor_id, request.incarnation, costs)
        return memory_pb2.HeartbeatResponse(lease_s=self.state.lease_s)

    async def ListExecutors(self, request, context):
        m = self.state.manager
        return memory_pb2.ListExecutorsResponse(
            executors=[spec_to_proto(kv.spec, m.costs.get(eid)) for eid, kv in m.executors.items()],
            last_step_id=m.last_step_id)

    async def Step(self, request, context):
        return plan_to_proto(self.state.step(step_from_proto(request)))

    async def Fork(self, request, context):
        shared = self.state.fork(request.fork.parent_seq_id, list(request.fork.child_seq_ids))
        return memory_pb2.ForkResponse(shared_blocks=shared)

    async def Free(self, request, context):
        released = self.state.free(list(request.seq_ids), request.abort)
        return memory_pb2.FreeResponse(blocks_released=released)

    def _snapshot(self, executor_id: str = "") -> memory_pb2.AccountingSnapshot:
        total, parts = self.state.manager.accounting(executor_id)
        mirror = self.state.mirror_status()
        return memory_pb2.AccountingSnapshot(
            time_s=time.time(), total=accounting_to_proto(total),
            executors=[accounting_to_proto(p) for p in parts],
            mirror_enabled=mirror.enabled, mirror_stale=mirror.stale, mirror_lag_events=mirror.lag_events,
            step_id=self.state.manager.last_step_id)

    async def GetAccounting(self, request, context):
        return self._snapshot(request.executor_id)

    def _watched(self) -> memory_pb2.AccountingSnapshot:
        """One snapshot for every watcher, computed at most once per
        ``snapshot_reuse_ms`` (each is O(blocks held), on the service's loop)."""
        now = time.monotonic()
        if self._shared is None or now - self._shared_at >= self.limits.snapshot_reuse_ms / 1000.0:
            self._shared, self._shared_at = self._snapshot(), now
        return self._shared

    async def WatchAccounting(self, request, context):
        lim = self.limits
        interval_ms = request.interval_ms or 1000
        if interval_ms < lim.min_watch_interval_ms:
            raise InvalidArgument(f"interval_ms must be at least {lim.min_watch_interval_ms} "
                                  "(min_watch_interval_ms)")
        if self._watchers >= lim.max_watchers:
            raise ResourceExhausted(f"{self._watchers} accounting watchers are open; the limit is "
                                    f"{lim.max_watchers} (max_watchers)", retry_after_s=5.0)
        self._watchers += 1
        try:
            while True:
                yield self._watched()
                await asyncio.sleep(interval_ms / 1000.0)
        finally:
            self._watchers -= 1

    async def ScorePrefix(self, request, context):
        if request.block_hashes:
            if len(request.namespace) != DIGEST_BYTES:
                raise InvalidArgument(f"namespace must be a {DIGEST_BYTES}-byte digest with block_hashes")
            scores = self.state.score_prefix_hashes(_hashes(request.block_hashes, "block_hashes"),
                                                    request.namespace, list(request.executor_ids))
        else:
            tokens = unpack_i32(request.token_ids, "token_ids")
            if tokens and min(tokens) < 0:  # the prefix hash packs them as uint32
                raise InvalidArgument("token_ids must be >= 0")
            scores = self.state.score_prefix(tokens, request.cache_salt, list(request.executor_ids))
        return memory_pb2.ScorePrefixResponse(scores=[
            memory_pb2.ExecutorScore(executor_id=s.executor_id, hit_blocks=s.hit_blocks, hit_tokens=s.hit_tokens,
                                     num_sequences=s.num_sequences, free_blocks=s.free_blocks,
                                     block_size=s.block_size)
            for s in scores])
