"""Planning a step: allocation in the caller's order, preemption when
someone cannot get room, and each executor's plan.

For each scheduled sequence, in order: a running one gets room for its next
tokens (copy-on-write where it would write into a shared block), a swapped
one is swapped in, a waiting one is admitted (prefix hits first). When that
fails, ``make_room`` preempts: the eligibility policy says who may give
blocks back, the victim policy who goes first, the mode policy how (swap or
recompute, from both modes' estimated cost at the executor's measured
rates; the decision and its estimate go into the step's output). With
per-tenant quotas a tenant at its quota preempts only its own sequences
and no tenant's are preempted for another's. Allocation for one sequence
either succeeds or that sequence is not scheduled: failure never leaves
partial state.

An executor's plan lists its rows (sequence, tokens computed now), the
changes to its block tables since its last plan and its cache ops; an
executor with neither rows nor ops gets no plan (its pending table changes
wait for the next one).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

from kvpager.seq_status import SeqStatus
from memory_service.block import Block
from memory_service.costs import ExecutorCosts
from memory_service.kv_manager import ExecutorKV
from memory_service.policy import (ModePolicy, PreemptionDecision, PreemptionMode, TenantQuota, VictimEligibility,
                                   VictimPolicy, estimate_preemption)
from memory_service.records import ExecutorStepPlan, StepInput, StepOutput
from memory_service.sequence import PLACEHOLDER, Sequence
from memory_service.validation import DecodeStep

# executor id -> its rows: (seq_ids int64, tokens each computes now int32), in allocation order
Rows = dict[str, tuple[array, array]]


def _add_row(rows: Rows, executor_id: str, seq_id: int, k: int) -> None:
    r = rows.get(executor_id)
    if r is None:
        r = rows[executor_id] = (array("q"), array("i"))
    r[0].append(seq_id)
    r[1].append(k)


def tenant_blocks(kv: ExecutorKV, seqs: dict[int, Sequence], tenant: str) -> set[int]:
    """Device blocks the tenant's sequences hold on this executor (each once)."""
    return {b for i in kv.seq_ids if (s := seqs[i]).tenant == tenant for b in s.block_ids}


def blocks_to_add(kv: ExecutorKV, seq: Sequence, k: int, held: set[int], ahead: int = 0) -> int:
    """Blocks seq's tenant would newly hold once seq has room for k more
    tokens (and, running, the ``ahead`` placeholders of a decode burst)."""
    bs = kv.block_size
    if seq.status is SeqStatus.RUNNING:
        k = min(k, seq.num_tokens - seq.num_computed) + ahead
        if kv.grouped:
            return kv.blocks_needed(seq, k)
        blocks = seq.blocks
        copies = sum(1 for b in blocks[seq.num_computed // bs:] if b.ref_cnt > 1)  # copy-on-write of a shared tail
        return max(0, -(-(seq.num_computed + k) // bs) - len(blocks)) + copies
    need, hits = kv.room_needed(seq, min(k, seq.num_tokens - seq.num_computed))
    return need + sum(1 for b in hits if b.block_id not in held)


def _rows_of(seqs: list[Sequence]) -> Rows:
    """Rows of one token each, for sequences already given room, grouped by executor."""
    rows: Rows = {}
    for seq in seqs:
        _add_row(rows, seq.executor_id, seq.seq_id, 1)
    return rows


class Planner:
    def __init__(self, seqs: dict[int, Sequence], executors: dict[str, ExecutorKV], *,
                 eligibility: VictimEligibility, victims: VictimPolicy, modes: ModePolicy,
                 costs: dict[str, ExecutorCosts] | None = None, quota: TenantQuota | None = None) -> None:
        self.seqs = seqs
        self.quota = quota  # per-tenant block quota (None: off)
        self._quota_bound: dict[tuple[str, str], int] = {}
        self.executors = executors
        self.costs = costs if costs is not None else {}  # executor id -> its last measured costs
        self.eligibility = eligibility
        self.victims = victims
        self.modes = modes
        self._placeholders = 0  # added by this plan's lookaheads (the manager counts them)

    def plan(self, step: StepInput, out: StepOutput, rejected: set[int], decode: DecodeStep | None = None) -> int:
        """Allocate step.schedule in order; fill out.executor_plans, preempted,
        unscheduled. Returns the placeholders granted lookaheads added."""
        self._placeholders = 0
        self.build_plans(self.schedule(step, out, rejected, decode), out)
        return self._placeholders

    def schedule(self, step: StepInput, out: StepOutput, rejected: set[int],
                 decode: DecodeStep | None = None) -> Rows:
        """Allocate step.schedule in order; fill out.preempted and out.unscheduled.
        Returns each executor's rows. ``decode``: the step passed
        ``StepValidator.check_decode``."""
        if decode is not None and self.quota is None:  # the fast path has no quota check
            return self._schedule_decode(step, out, decode)
        return self._schedule(step.schedule_seq_ids, step.schedule_num_tokens, out, rejected, {}, set(),
                              step.schedule_lookahead)

    def _schedule(self, seq_ids, num_tokens, out: StepOutput, rejected: set[int], rows: Rows,
                  handled: set[int], lookahead=()) -> Rows:
        """``lookahead``: per scheduled sequence (empty: none), tokens a running
        one samples ahead in this step: its slots are allocated with its
        tokens, all or nothing, and the placeholders join it once granted."""
        seqs = self.seqs
        # handled: scheduled (or given up) in this step: never a victim after
        preempted: set[int] = set()
        admission_closed: set = set()  # executor ids (with quotas: (executor id, tenant))
        self._quota_bound: dict[tuple[str, str], int] = {}  # (executor, tenant) -> blocks held at most
        running, swapped = SeqStatus.RUNNING, SeqStatus.SWAPPED
        kv = None
        for i, (seq_id, k) in enumerate(zip(seq_ids, num_tokens)):
            ahead = lookahead[i] if lookahead else 0
            if seq_id in rejected:
                continue
            seq = seqs[seq_id]
            handled.add(seq_id)
            if preempted and seq_id in preempted:
                out.unscheduled.append(seq_id)
                continue
            if kv is None or kv.spec.executor_id != seq.executor_id:
                kv = self.executors[seq.executor_id]
            status = seq.status
            # With quotas, one tenant's request that does not fit closes admission for that tenant only.
            gate = (kv.spec.executor_id, seq.tenant) if self.quota is not None else kv.spec.executor_id
            if status is not running and status is not swapped and gate in admission_closed:
                out.unscheduled.append(seq_id)  # FCFS: no overtaking a request that did not fit
                continue
            if ahead and self.quota is not None and not self._burst_within_quota(kv, seq, k, ahead):
                ahead = 0  # a burst never takes its tenant over its quota: it computes its token alone
            if self.quota is not None and not self._fit_quota(kv, seq, k, handled, out, preempted, ahead):
                out.unscheduled.append(seq_id)  # its tenant is at its quota: it waits (others go on)
                if status is not running and status is not swapped:
                    admission_closed.add(gate)
                continue
            if status is running:
                k = min(k, len(seq.token_ids) - seq.num_computed) + ahead  # >= 1, validated
                ok = kv.allocate_slots(seq, k) or self.make_room(
                    kv, seq, lambda kv=kv, seq=seq, k=k: kv.allocate_slots(seq, k), None, handled, out, preempted)
                if ok and ahead:  # the tokens it samples ahead: placeholders until appended
                    seq.token_ids.extend([PLACEHOLDER] * ahead)
                    seq.num_pending += ahead
                    self._placeholders += ahead
                if not ok and kv.grouped and seq.status is running and not ahead:
                    k = kv.fit_tokens(seq, k)  # a smaller chunk: the window frees behind it
                    ok = k > 0 and kv.allocate_slots(seq, k)
                if ok:
                    _add_row(rows, kv.spec.executor_id, seq_id, k)
                    kv.commit(seq, k)
                else:
                    out.unscheduled.append(seq_id)
            elif status is swapped:
                k = min(k, seq.num_tokens - seq.num_computed)
                if self.make_room(kv, seq, lambda kv=kv, seq=seq, k=k: kv.swap_in(seq, k),
                                  lambda: kv.room_needed(seq, k), handled, out, preempted):
                    _add_row(rows, kv.spec.executor_id, seq_id, k)
                    kv.commit(seq, k)
                else:
                    out.unscheduled.append(seq_id)
            else:  # WAITING: new, or preempted by recompute
                first = not seq.admitted
                granted: list[int] = []

                def admit(kv=kv, seq=seq, k=k, first=first) -> bool:
                    r = kv.admit(seq, k, count_hits=first)
                    if r is None:
                        return False
                    granted.append(r[1])
                    return True

                ok = self.make_room(kv, seq, admit, lambda kv=kv, seq=seq, k=k: kv.room_needed(seq, k),
                                    handled, out, preempted)
                if not ok and kv.grouped:
                    part = kv.fit_tokens(seq, k)  # a smaller first chunk: the window frees behind it
                    ok = part > 0 and admit(k=part)
                if ok:
                    if first:
                        seq.admitted = True
                        seq.num_cached_tokens = seq.num_computed  # the prefix hit
                    _add_row(rows, kv.spec.executor_id, seq_id, granted[0])
                    kv.commit(seq, granted[0])
                else:
                    out.unscheduled.append(seq_id)
                    admission_closed.add(gate)
        return rows

    def _schedule_decode(self, step: StepInput, out: StepOutput, decode: DecodeStep) -> Rows:
        """One token for each scheduled sequence, all RUNNING, in order. The
        common case, room left in a private tail block, is a few attribute
        reads: a running sequence holds exactly ceil(num_computed / block_size)
        blocks, so its tail has room iff num_computed is not a multiple of the
        block size (the test ``allocate_slots`` makes, without the call). A
        full tail takes ``open_block``, a shared one ``allocate_slots`` (the
        copy); the first sequence that cannot get room without preempting
        hands itself and the rest of the schedule to the general loop, so who
        is preempted and what goes unscheduled is the general loop's answer."""
        executors = self.executors
        eid = kv = None
        bs = 0
        num_executors = 0
        scheduled = decode.scheduled
        for seq in scheduled:
            if seq.executor_id != eid:
                eid = seq.executor_id
                kv = executors[eid]
                bs = kv.block_size
                num_executors += 1
            c = seq.num_computed
            if c % bs:  # room left in the tail block; a shared one is copied first
                ok = seq.blocks[-1].ref_cnt == 1 or kv.allocate_slots(seq, 1)
            else:       # the tail is full: a fresh block
                ok = kv.open_block(seq)
            if not ok:
                j = scheduled.index(seq)
                sids = step.schedule_seq_ids
                return self._schedule(sids[j:], step.schedule_num_tokens[j:], out, set(),
                                      _rows_of(scheduled[:j]), set(sids[:j]))
            if (c + 1) % bs:
                seq.num_computed = c + 1
            else:
                kv.commit(seq, 1)  # the tail is full now: it enters the prefix index
        if num_executors == 1:
            return {eid: (array("q", step.schedule_seq_ids), array("i", [1]) * len(scheduled))}
        return _rows_of(scheduled)

    def build_plans(self, rows: Rows, out: StepOutput) -> None:
        """Each executor's plan: its rows, table changes and cache ops (none for
        an executor with neither rows nor ops)."""
        for executor_id, kv in self.executors.items():
            plan_rows = rows.get(executor_id)
            ops = kv.take_ops()
            if not plan_rows and not ops:
                assert not kv.tables.has_row_changes, "table starts and extends come with rows"
                continue
            plan = ExecutorStepPlan(executor_id, kv.spec.incarnation, kv.table_epoch, tables=kv.take_tables(),
                                    group_tables=kv.take_group_tables(), ops=ops)
            if plan_rows:
                plan.seq_ids, plan.query_lens = plan_rows
            out.executor_plans.append(plan)

    def make_room(self, kv: ExecutorKV, seq: Sequence, attempt: Callable[[], bool],
                  room_needed: Callable[[], tuple[int, list[Block]]] | None, handled: set[int],
                  out: StepOutput, preempted: set[int]) -> bool:
        """Run attempt(); while it fails, preempt the victim policy's pick among
        the eligible running sequences not yet handled in this step.

        A requester that may be its own victim (a running sequence that cannot
        grow) stops once it is picked: it gives its own blocks back and waits.
        Any other preempts only while preempting every eligible sequence could
        make room (``room_needed``: the free blocks the attempt needs and the
        cached blocks it would take back itself), so no one loses blocks for
        nothing."""
        if attempt():
            return True
        need, hits = room_needed() if room_needed is not None else (0, [])
        reused = set(hits)
        eligible = self.eligibility.eligible
        while True:
            own_only = self.quota is not None  # with quotas no tenant is preempted for another
            candidates = [s for s in (self.seqs[i] for i in kv.seq_ids)
                          if s.status is SeqStatus.RUNNING and (s.seq_id not in handled or s is seq)
                          and eligible(s, seq) and (not own_only or s.tenant == seq.tenant)]
            if not candidates:
                return False
            if room_needed is not None:
                # Blocks only candidates hold, less the cached hits the attempt takes back itself.
                holders: dict[Block, int] = {}
                for s in candidates:
                    for b in s.blocks:
                        holders[b] = holders.get(b, 0) + 1
                reclaimable = sum(1 for b, n in holders.items() if n == b.ref_cnt and b not in reused)
                free = kv.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)
                if free + reclaimable < need:
                    return False
            taken = max(1, need - kv.pool.num_free)  # what the requester takes of a victim's freed blocks
            costs = self.costs.get(kv.spec.executor_id)
            victim = self.victims.select(candidates, lambda s: estimate_preemption(
                s, kv.block_size, kv.swap.num_free, costs, taken))
            self.preempt(victim, kv, out, preempted, taken)
            if victim is seq:
                return False
            if attempt():
                return True

    def _burst_within_quota(self, kv: ExecutorKV, seq: Sequence, k: int, ahead: int) -> bool:
        """Whether seq's tenant stays within its quota once seq holds its next
        k tokens and ``ahead`` placeholders (no one preempted to make it so)."""
        held = tenant_blocks(kv, self.seqs, seq.tenant)
        return len(held) + blocks_to_add(kv, seq, k, held, ahead) <= self.quota.cap(kv.pool.num_blocks)

    def _fit_quota(self, kv: ExecutorKV, seq: Sequence, k: int, handled: set[int], out: StepOutput,
                   preempted: set[int], ahead: int = 0) -> bool:
        """Whether seq may take the blocks its next k tokens need without its
        tenant going over its quota, preempting the tenant's own sequences
        (by the same eligibility and victim policies) until it may."""
        cap = self.quota.cap(kv.pool.num_blocks)
        # An upper bound of the tenant's blocks, kept through the step, spares the walk while it fits
        # (it only grows by what each grant could add, and preemptions only lower the truth).
        key = (kv.spec.executor_id, seq.tenant)
        bound = self._quota_bound.get(key)
        upper = blocks_to_add(kv, seq, k, set(), ahead)
        if bound is not None and bound + upper <= cap:
            self._quota_bound[key] = bound + upper
            return True
        eligible = self.eligibility.eligible
        while True:
            held = tenant_blocks(kv, self.seqs, seq.tenant)
            add = blocks_to_add(kv, seq, k, held, ahead)
            if len(held) + add <= cap:
                self._quota_bound[key] = len(held) + add
                return True
            candidates = [s for s in (self.seqs[i] for i in kv.seq_ids)
                          if s.tenant == seq.tenant and s.status is SeqStatus.RUNNING
                          and (s.seq_id not in handled or s is seq) and eligible(s, seq)]
            if not candidates:
                return False
            costs = self.costs.get(kv.spec.executor_id)
            victim = self.victims.select(candidates, lambda s: estimate_preemption(
                s, kv.block_size, kv.swap.num_free, costs))
            self.preempt(victim, kv, out, preempted)
            if victim is seq:
                return False

    def preempt(self, victim: Sequence, kv: ExecutorKV, out: StepOutput, preempted: set[int],
                taken_blocks: int = 1) -> PreemptionDecision:
        est = estimate_preemption(victim, kv.block_size, kv.swap.num_free, self.costs.get(kv.spec.executor_id),
                                  taken_blocks)
        decision = self.modes.choose(victim, est)
        mode = decision.mode
        c = kv.counters
        if mode is PreemptionMode.SWAP:
            kv.preempt_swap(victim)
            c.preempt_swap_bytes += 2 * est.swap_bytes
        else:
            kv.preempt_recompute(victim)
            c.preempt_recompute_tokens += est.recompute_tokens
        chosen, other = est.cost_s(mode), est.cost_s(
            PreemptionMode.RECOMPUTE if mode is PreemptionMode.SWAP else PreemptionMode.SWAP)
        if chosen is not None:
            c.preempt_cost_s += chosen
            if other is not None and est.swap_fits:
                c.preempt_saved_s += other - chosen
        preempted.add(victim.seq_id)
        out.preempted.append((victim.seq_id, mode))
        out.decisions.append(decision)
        return decision
