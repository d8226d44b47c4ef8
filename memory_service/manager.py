"""The memory manager: every executor's pool and every sequence, one Step at a time.

A Step is validated completely before anything changes (``validation``:
all-or-nothing), then applied in a fixed order: forks, appended tokens,
frees, aborts, new sequences, schedule. Forks come first so that one step
can fork a sequence and give each child its own sampled token (n > 1, beam
search), and frees after appends so a pruned beam's parent can be forked and
freed at once. The schedule is planned by ``planner`` (allocation in the
caller's order, preemption by the policies, each executor's plan).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from kvpager.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvpager.log_limits import clip
from kvpager.prefix_index.hashing import namespace_digest, root_hash
from memory_service.accounting import PoolAccounting, check_invariants, executor_accounting, total_accounting
from memory_service.events import EventQueue
from memory_service.grouped_kv import GroupedExecutorKV
from memory_service.kv_manager import ExecutorKV, ExecutorSpec
from memory_service.limits import MemoryLimits, check_name
from memory_service.planner import Planner
from memory_service.costs import ExecutorCosts
from memory_service.policy import (CostModePolicy, EvictionPolicy, ModePolicy, RetentionEvictionPolicy, TenantQuota,
                                   VictimEligibility, VictimPolicy)
from memory_service.retention import PinBudget
from memory_service.records import NewSeq, PrefixScore, Rejected, RejectionReason, StepInput, StepOutput
from memory_service.sequence import PLACEHOLDER, Sequence
from memory_service.validation import DecodeStep, StepValidator


MAX_KV_GROUPS = 256  # table groups one executor may register (a model's layers, at one per group)


class MemoryManager:
    def __init__(self, victim_policy: VictimPolicy | None = None, mode_policy: ModePolicy | None = None,
                 events: EventQueue | None = None, *, eligibility: VictimEligibility | None = None,
                 eviction: EvictionPolicy | None = None, limits: MemoryLimits | None = None,
                 quota: TenantQuota | None = None, retention: PinBudget | None = None) -> None:
        self.limits = limits or MemoryLimits()
        # Prefix retention: pins budgeted per tenant, retained blocks evicted last (no budget: no pins).
        self.retention = retention or PinBudget(None)
        if eviction is None and self.retention.quota is not None:
            eviction = RetentionEvictionPolicy(self.retention.clock)
        self.victim_policy = victim_policy or VictimPolicy()
        self.mode_policy = mode_policy or CostModePolicy()
        self.eviction = eviction or EvictionPolicy()
        self.events = events if events is not None else EventQueue()
        self.executors: dict[str, ExecutorKV] = {}
        self.seqs: dict[int, Sequence] = {}
        self._namespaces: dict[str, bytes] = {}
        self.costs: dict[str, ExecutorCosts] = {}  # executor id -> what it last measured (mode policy input)
        self.validator = StepValidator(self.seqs, self.executors, max_fork_children=self.limits.max_fork_children)
        self.planner = Planner(self.seqs, self.executors, eligibility=eligibility or VictimEligibility(),
                               victims=self.victim_policy, modes=self.mode_policy, costs=self.costs,
                               quota=quota)
        self._arrivals = itertools.count()
        self.last_step_id = 0
        self._last_output: StepOutput | None = None
        self._num_grouped = 0  # executors with a table per KV group: the decode fast path assumes one table

    # ---- executors ------------------------------------------------------------

    def register_executor(self, spec: ExecutorSpec, costs: ExecutorCosts | None = None) -> bool:
        """Add (or replace) an executor's pool. Returns True when an earlier
        incarnation was dropped together with its sequences. ``costs``: what
        it measured so far (kept until the next report)."""
        if spec.num_blocks <= 0 or spec.block_size <= 0 or spec.num_swap_blocks < 0:
            raise InvalidArgument("num_blocks and block_size must be positive, num_swap_blocks >= 0")
        if not spec.executor_id:
            raise InvalidArgument("executor_id must not be empty")
        self._check_registration(spec)
        old = self.executors.get(spec.executor_id)
        if old is not None:
            same = (old.spec.incarnation == spec.incarnation and old.spec.pool_generation == spec.pool_generation
                    and old.spec.num_blocks == spec.num_blocks and old.spec.block_size == spec.block_size
                    and old.spec.kv_group_windows == spec.kv_group_windows)
            if same:
                old.spec.address = spec.address or old.spec.address
                self.update_costs(spec.executor_id, costs)
                return False
            self._drop_executor(old)
        make = GroupedExecutorKV if spec.kv_group_windows else ExecutorKV
        self.executors[spec.executor_id] = make(spec, self.events, self.eviction)
        self._num_grouped = sum(1 for kv in self.executors.values() if kv.grouped)
        self.costs.pop(spec.executor_id, None)
        self.update_costs(spec.executor_id, costs)
        self._namespaces[spec.executor_id] = namespace_digest(spec.model_id, spec.block_size, spec.dtype,
                                                              spec.adapter)
        return old is not None

    def update_costs(self, executor_id: str, costs: ExecutorCosts | None) -> None:
        """An executor's newest measurements (registration, heartbeats); None keeps the last."""
        self._executor(executor_id)
        if costs is not None:
            self.costs[executor_id] = costs

    def _check_registration(self, spec: ExecutorSpec) -> None:
        """Names, pool sizes and the registry's room, before anything is built."""
        lim = self.limits
        check_name(spec.executor_id, "executor_id", lim.max_executor_id_chars, "max_executor_id_chars")
        for name in ("address", "model_id", "dtype", "adapter"):
            check_name(getattr(spec, name), name, lim.max_name_chars, "max_name_chars")
        if len(spec.kv_group_windows) > MAX_KV_GROUPS:
            raise InvalidArgument(f"kv_group_windows: {len(spec.kv_group_windows)} groups; the limit is {MAX_KV_GROUPS}")
        if spec.num_blocks > lim.max_pool_blocks or spec.num_swap_blocks > lim.max_pool_blocks:
            raise InvalidArgument(f"num_blocks and num_swap_blocks must be <= {lim.max_pool_blocks} "
                                  "(max_pool_blocks)")
        others = [kv for eid, kv in self.executors.items() if eid != spec.executor_id]
        if len(others) >= lim.max_executors:
            raise ResourceExhausted(f"{len(others)} executors are registered; the limit is {lim.max_executors} "
                                    "(max_executors)")
        held = sum(kv.spec.num_blocks + kv.spec.num_swap_blocks for kv in others)
        if held + spec.num_blocks + spec.num_swap_blocks > lim.max_total_blocks:
            raise ResourceExhausted(f"registered pools hold {held} blocks; {spec.num_blocks + spec.num_swap_blocks} "
                                    f"more is over the limit of {lim.max_total_blocks} (max_total_blocks)")

    def deregister_executor(self, executor_id: str, incarnation: int = 0) -> int:
        kv = self._executor(executor_id)
        if incarnation and kv.spec.incarnation != incarnation:
            raise FailedPrecondition(f"executor {clip(executor_id)!r} is at incarnation {kv.spec.incarnation}, "
                                     f"not {incarnation}")
        dropped = self._drop_executor(kv)
        del self.executors[executor_id]
        self._num_grouped = sum(1 for kv in self.executors.values() if kv.grouped)
        self.costs.pop(executor_id, None)
        return dropped

    def _drop_executor(self, kv: ExecutorKV) -> int:
        ids = list(kv.seq_ids)
        for seq_id in ids:
            seq = self.seqs.pop(seq_id)
            self.validator.pending_total -= seq.num_pending
            kv.release(seq)
            self.validator.remember_freed(seq_id)
        kv.seq_ids.clear()
        kv.pool.clear()
        self.retention.forget(kv.spec.executor_id)
        return len(ids)

    def _executor(self, executor_id: str) -> ExecutorKV:
        kv = self.executors.get(executor_id)
        if kv is None:
            raise NotFound(f"unknown executor {clip(executor_id)!r}")
        return kv

    def _token_limit(self, seq: Sequence) -> int:
        kv = self.executors[seq.executor_id]
        spec = kv.spec
        limit = kv.pool_tokens()
        if spec.max_model_len:
            limit = min(limit, spec.max_model_len)
        if seq.max_total_tokens:
            limit = min(limit, seq.max_total_tokens)
        return limit

    # ---- the step ---------------------------------------------------------------

    def step(self, step: StepInput) -> StepOutput:
        if step.step_id and step.step_id == self.last_step_id and self._last_output is not None:
            return self._last_output  # a retried step: same plan, no second application
        if step.step_id and step.step_id < self.last_step_id:
            # Step ids start from the gateway's clock: an older one comes from a
            # gateway another has replaced (the single writer fence).
            raise Aborted(f"step {step.step_id} is older than the last step {self.last_step_id}: "
                          "another gateway drives this memory service")
        decode = None if self._num_grouped else self.validator.check_decode(step)
        if decode is None:
            self.validator.check(step)
        out = StepOutput(step.step_id)
        rejected = self.apply(step, out, decode)
        self.validator.pending_total += self.planner.plan(step, out, rejected, decode)
        if step.step_id:
            self.last_step_id = step.step_id
            self._last_output = out
        return out

    def apply(self, step: StepInput, out: StepOutput, decode: DecodeStep | None = None) -> set[int]:
        """A validated step's forks, appends, frees, aborts and new sequences;
        rejections go to out. Returns the rejected new sequences' ids.
        ``decode``: the step passed ``StepValidator.check_decode`` (appends only)."""
        if decode is not None:
            for seq, token in zip(decode.appended, step.appended_tokens):
                seq.token_ids.append(token)
            return set()
        for parent_id, children in step.forks:
            self._fork(parent_id, children)
        ids, offs, toks = step.appended_seq_ids, step.appended_offsets, step.appended_tokens
        cut = {*step.cut_seq_ids, *step.carried_seq_ids}
        for i, seq_id in enumerate(ids):
            seq = self.seqs[seq_id]
            chunk = toks[offs[i]:offs[i + 1]]
            if seq.num_pending and len(chunk):
                # The first tokens are the ones an earlier step held placeholders for.
                k = min(seq.num_pending, len(chunk))
                start = len(seq.token_ids) - seq.num_pending
                seq.token_ids[start:start + k] = chunk[:k]
                seq.num_pending -= k
                self.validator.pending_total -= k
                chunk = chunk[k:]
                if seq_id not in cut:  # a cut one is indexed once its computed count is cut
                    self.executors[seq.executor_id].index_known(seq)
            seq.token_ids.extend(chunk)
        for seq_id in step.cut_seq_ids:
            self._cut(self.seqs[seq_id])
        for seq_id in step.carried_seq_ids:
            self._cut(self.seqs[seq_id], carried=True)
        for seq_id in step.free_seq_ids:
            self._free(seq_id)
        for seq_id in step.abort_seq_ids:
            self._free(seq_id)
        rejected: set[int] = set()
        for new in step.new_seqs:
            rejection = self._create(new)
            if rejection is not None:
                out.rejected.append(rejection)
                rejected.add(new.seq_id)
        for seq_id in step.pending_seq_ids:
            seq = self.seqs[seq_id]
            seq.token_ids.append(PLACEHOLDER)
            seq.num_pending += 1
            self.validator.pending_total += 1
        return rejected

    def _cut(self, seq: Sequence, carried: bool = False) -> None:
        """Its burst was cut short: the placeholders left go; its tokens but the
        last (sampled by the last sub-step that ran) are computed, or all of
        them where its next sub-step was ``carried`` into the step that cut it."""
        if seq.num_pending:
            del seq.token_ids[-seq.num_pending:]
            self.validator.pending_total -= seq.num_pending
            seq.num_pending = 0
        kv = self.executors[seq.executor_id]
        kv.cut(seq, len(seq.token_ids) - (0 if carried else 1))
        kv.index_known(seq)

    def _create(self, new: NewSeq) -> Rejected | None:
        kv = self.executors[new.executor_id]
        n = len(new.prompt_token_ids)
        limit = kv.spec.max_model_len or kv.spec.num_blocks * kv.spec.block_size
        if n >= limit + 1 or (new.max_total_tokens and new.max_total_tokens > limit):
            return Rejected(new.seq_id, RejectionReason.OVER_CONTEXT_LIMIT,
                            f"sequence needs {max(n, new.max_total_tokens)} tokens, over the context limit {limit}")
        if not kv.can_ever_fit(max(n, new.max_total_tokens)):
            return Rejected(new.seq_id, RejectionReason.OVER_POOL,
                            f"sequence needs {max(n, new.max_total_tokens)} tokens; the executor's KV pool "
                            f"holds {kv.pool_tokens()} in all")
        quota = self.planner.quota
        if quota is not None:
            cap = quota.cap(kv.spec.num_blocks)
            if -(-max(n, new.max_total_tokens) // kv.block_size) > cap:
                return Rejected(new.seq_id, RejectionReason.OVER_QUOTA,
                                f"sequence needs {max(n, new.max_total_tokens)} tokens; its tenant may hold "
                                f"{cap * kv.block_size} on this executor (tenant quota)")
        seq = Sequence(new.seq_id, new.executor_id, list(new.prompt_token_ids),
                       root_hash(self._namespaces[new.executor_id], new.cache_salt),
                       priority=new.priority, arrival=next(self._arrivals),
                       max_total_tokens=new.max_total_tokens, num_prompt_tokens=n, request_id=new.request_id,
                       tenant=new.tenant, retention_s=new.retention_s)
        seq.token_limit = self._token_limit(seq)
        if new.prompt_block_hashes:
            seq.block_hashes = list(new.prompt_block_hashes)  # computed once, by the router
        self.seqs[new.seq_id] = seq
        kv.seq_ids.add(new.seq_id)
        self.validator.forget_freed(new.seq_id)
        return None

    def _fork(self, parent_id: int, children: Iterable[int]) -> int:
        parent = self.seqs[parent_id]
        kv = self.executors[parent.executor_id]
        shared = 0
        for child_id in children:
            child = Sequence(child_id, parent.executor_id, list(parent.token_ids), parent.root_hash,
                             priority=parent.priority, arrival=parent.arrival,
                             max_total_tokens=parent.max_total_tokens, admitted=parent.admitted,
                             num_cached_tokens=parent.num_cached_tokens,
                             num_prompt_tokens=parent.num_prompt_tokens, token_limit=parent.token_limit,
                             request_id=parent.request_id, tenant=parent.tenant,
                             retention_s=parent.retention_s)
            shared += kv.fork(parent, child)
            self.seqs[child_id] = child
            kv.seq_ids.add(child_id)
            self.validator.forget_freed(child_id)
        return shared

    def _free(self, seq_id: int) -> int:
        seq = self.seqs.pop(seq_id)
        self.validator.pending_total -= seq.num_pending
        kv = self.executors[seq.executor_id]
        kv.seq_ids.discard(seq_id)
        self.validator.remember_freed(seq_id)
        if seq.retention_s > 0 and seq.blocks:  # pinned before the free: the eviction policy reads the pin
            self.retention.pin(seq, kv.pool.num_blocks, kv.block_size)
        return kv.release(seq)

    # ---- stand-alone operations ---------------------------------------------------

    def fork(self, parent_id: int, child_ids: list[int]) -> int:
        self.validator.check(StepInput(forks=[(parent_id, child_ids)]))
        return self._fork(parent_id, child_ids)

    def free(self, seq_ids: Iterable[int], abort: bool = False) -> int:
        seq_ids = list(seq_ids)
        if abort:
            self.validator.check(StepInput(abort_seq_ids=seq_ids))
        else:
            self.validator.check(StepInput(free_seq_ids=seq_ids))
        return sum(self._free(s) for s in seq_ids)

    # ---- prefix scoring -------------------------------------------------------------

    def _wanted(self, executor_ids: Iterable[str]) -> list[str]:
        """The executors a score asks for: distinct, at most ``max_executors`` (all when none)."""
        wanted = list(dict.fromkeys(executor_ids))
        if len(wanted) > self.limits.max_executors:
            raise InvalidArgument(f"{len(wanted)} distinct executor ids; the limit is {self.limits.max_executors} "
                                  "(max_executors)")
        return wanted or list(self.executors)

    def score_prefix(self, token_ids, cache_salt: str = "", executor_ids: Iterable[str] = ()) -> list[PrefixScore]:
        wanted = self._wanted(executor_ids)
        scores = []
        for executor_id in wanted:
            kv = self._executor(executor_id)
            root = root_hash(self._namespaces[executor_id], cache_salt)
            hit = kv.count_prefix_blocks(root, token_ids)
            scores.append(PrefixScore(executor_id, hit, hit * kv.block_size, len(kv.seq_ids),
                                      kv.pool.num_free, kv.block_size))
        return scores

    def score_prefix_hashes(self, block_hashes: list[bytes], namespace: bytes,
                            executor_ids: Iterable[str] = ()) -> list[PrefixScore]:
        """Scoring by a chain the caller computed (from `namespace` and its salt);
        executors of another namespace hold none of it."""
        scores = []
        for executor_id in self._wanted(executor_ids):
            kv = self._executor(executor_id)
            hit = kv.count_prefix_hashes(block_hashes) if self._namespaces[executor_id] == namespace else 0
            scores.append(PrefixScore(executor_id, hit, hit * kv.block_size, len(kv.seq_ids),
                                      kv.pool.num_free, kv.block_size))
        return scores

    # ---- accounting ---------------------------------------------------------------

    def accounting(self, executor_id: str = "") -> tuple[PoolAccounting, list[PoolAccounting]]:
        """(total, per executor); with executor_id, only that executor."""
        kvs = [self._executor(executor_id)] if executor_id else list(self.executors.values())
        parts = [executor_accounting(kv, self.seqs, self.costs.get(kv.spec.executor_id),
                                     self.retention.count(kv.spec.executor_id)) for kv in kvs]
        return total_accounting(parts), parts

    def check_invariants(self) -> list[str]:
        bad = []
        for kv in self.executors.values():
            bad.extend(f"{kv.spec.executor_id}: {v}" for v in check_invariants(kv, self.seqs))
        owned = sum(len(kv.seq_ids) for kv in self.executors.values())
        if owned != len(self.seqs):
            bad.append(f"{len(self.seqs)} sequences but executors list {owned}")
        return bad

    def sequence(self, seq_id: int) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise self.validator.missing(seq_id, "lookup")
        return seq


