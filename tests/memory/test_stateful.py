"""Property test: a hypothesis state machine plays the gateway against
MemoryManager.step, with a simulated executor holding what each slot contains.

Each rule is one Step (or one re-registration): new requests from a small
alphabet so prefixes repeat, decode appends, chunked prefill, forks whose
children diverge, frees and aborts, floods of distinct prompts (eviction),
malformed steps (must change nothing), retried steps, executor
re-registration. Pools are tiny and swap pools vary, so preemption by both
modes happens all the time. Each example draws the mode policy (threshold,
the measured-cost model with random rates, always recompute, always swap),
the victim policy, an optional per-tenant quota and a pin budget; requests
carry one of three tenants and sometimes a retention_s (a clock that ticks
once a rule expires pins).

The simulated executor applies each plan as the real one does — swap-outs,
swap-ins, copies, then the forward writes every planned slot before any row
reads its context — and stores in each slot the (salt, token prefix) whose KV
it would hold. So besides check_invariants() == [] after every rule, it
checks that every row reads exactly its own tokens' KV, that every live
sequence's computed KV (on device or in the swap pool) is intact, that plan
tables equal the sequences' tables, FCFS admission (per tenant with quotas),
that the KV-event stream rebuilds the prefix index exactly, the accounting
identities, that no tenant holds more than its quota and none is preempted
for another's sake, that each preemption's decision carries its estimate,
and that pins stay within their budgets and are evicted last.

CI runs 100 examples of up to 140 rules: at least 10,000 rules (asserted),
about 10 s on 2 cores. A longer run (about 120,000 rules, 2 minutes):
    KVPAGER_STATEFUL_EXAMPLES=1000 python -m pytest tests/memory/test_stateful.py -q -s
"""

from __future__ import annotations

import math
import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from kvpager.errors import KvpagerError
from memory_service.events import AllCleared, BlockRemoved, BlockStored, EventQueue
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.costs import ExecutorCosts
from memory_service.planner import tenant_blocks
from memory_service.policy import VICTIM_POLICIES, PreemptionMode, TenantQuota, make_mode_policy
from memory_service.retention import PinBudget
from memory_service.records import NewSeq, StepInput
from kvpager.seq_status import SeqStatus
from plan_mirror import TableMirror, domain_view
from memory_service.records import RejectionReason

EXAMPLES = int(os.environ.get("KVPAGER_STATEFUL_EXAMPLES", "100"))
STEPS = 140  # per example (the initialize step included); hypothesis ends some examples early
VOCAB = 12
TEMPLATES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5], [])
EXECUTORS = ("e0", "e1")

RULES_RUN = [0]  # rules executed by this process, over all examples
# What the runs exercised (printed, and each must have happened at least once).
STATS = dict.fromkeys(("preempt_recompute", "preempt_swap", "cow_copies", "swap_ins", "prefix_hits", "evictions",
                       "rejected", "unscheduled", "bad_steps", "retries", "reregistrations", "fast_decodes",
                       "cost_decisions", "over_quota", "pins", "cut_bursts"), 0)
TENANTS = ("", "a", "b")


class Slots:
    """What one executor's device and swap pools hold, slot by slot."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.dev: dict[int, tuple] = {}
        self.cpu: dict[int, tuple] = {}

    def apply_ops(self, ops) -> None:
        bs = self.bs
        assert len(ops.swap_out_src) == len(ops.swap_out_dst)
        assert len(ops.swap_in_src) == len(ops.swap_in_dst)
        assert len(ops.copy_src) == len(ops.copy_dst)
        for src, dst in zip(ops.swap_out_src, ops.swap_out_dst):
            for off in range(bs):
                self.cpu[dst * bs + off] = self.dev.get(src * bs + off)
        for src, dst in zip(ops.swap_in_src, ops.swap_in_dst):
            for off in range(bs):
                self.dev[dst * bs + off] = self.cpu.get(src * bs + off)
        # one batched copy: every source is read before any destination is written
        moved = [[self.dev.get(src * bs + off) for off in range(bs)] for src in ops.copy_src]
        for dst, values in zip(ops.copy_dst, moved):
            for off, value in enumerate(values):
                self.dev[dst * bs + off] = value


def kv_of(salt: str, tokens: list[int], pos: int) -> tuple:
    """The KV a slot holds for position pos: a function of every token up to it."""
    return (salt, tuple(tokens[:pos + 1]))


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: MemoryManager | None = None

    # ---- set-up -----------------------------------------------------------------------

    @initialize(block_sizes=st.tuples(st.sampled_from([2, 4]), st.sampled_from([1, 2, 4])),
                num_blocks=st.tuples(st.integers(3, 10), st.integers(8, 16)),
                num_swap=st.tuples(st.integers(0, 8), st.integers(0, 3)),
                max_model_len=st.tuples(st.sampled_from([0, 12, 24]), st.sampled_from([0, 40])),
                swap_min_tokens=st.sampled_from([1, 3, 8, 10**6]),
                mode=st.sampled_from(["threshold", "threshold", "cost", "cost", "recompute", "swap"]),
                victim=st.sampled_from(sorted(VICTIM_POLICIES)),
                quota=st.sampled_from([None, None, 0.5, 4]), pin_budget=st.sampled_from([None, 0.3, 2]),
                rates=st.tuples(st.floats(1.0, 1e4), st.floats(1e2, 1e7)))
    def setup(self, block_sizes, num_blocks, num_swap, max_model_len, swap_min_tokens, mode, victim, quota,
              pin_budget, rates):
        self.events = EventQueue(enabled=True)
        self.now = [0.0]
        self.quota = TenantQuota(quota) if quota else None
        self.m = MemoryManager(mode_policy=make_mode_policy(mode, swap_min_tokens),
                               victim_policy=VICTIM_POLICIES[victim](), events=self.events, quota=self.quota,
                               retention=PinBudget(TenantQuota(pin_budget) if pin_budget else None,
                                                   clock=lambda: self.now[0]))
        self.mode = mode
        self.rates = rates
        self.specs: dict[str, ExecutorSpec] = {}
        self.slots: dict[str, Slots] = {}
        self.mirrors: dict[str, TableMirror] = {}      # the executors' tables, replayed from the plans
        self.index: dict[str, dict[bytes, int]] = {}   # rebuilt from the event stream
        for i, eid in enumerate(EXECUTORS):
            self._register(ExecutorSpec(eid, num_blocks=num_blocks[i], block_size=block_sizes[i],
                                        num_swap_blocks=num_swap[i], model_id="m", dtype="float32",
                                        incarnation=1, pool_generation=1, max_model_len=max_model_len[i],
                                        vocab_size=VOCAB))
        self.tokens: dict[int, list[int]] = {}     # the gateway's view of every live sequence
        self.salt: dict[int, str] = {}
        self.limit: dict[int, int] = {}
        self.freed: list[int] = []
        self.next_seq_id = 1
        self.step_id = 0
        self.last: tuple[StepInput, object] | None = None
        # A decode burst in the step being run: seq -> (the tokens it samples, the sub-steps it runs)
        self.burst: dict[int, tuple[list[int], int]] = {}

    def _register(self, spec: ExecutorSpec) -> None:
        # the cost model's inputs: random measured rates (a slow or fast host link against the prefill)
        tps, bw = self.rates
        self.m.register_executor(spec, ExecutorCosts((1, 8), (tps, 4 * tps), bw, 64 * spec.block_size))
        self.specs[spec.executor_id] = spec
        self.slots[spec.executor_id] = Slots(spec.block_size)
        # a restarted executor keeps nothing; the new registration's epoch tells it so anyway
        self.mirrors.setdefault(spec.executor_id, TableMirror(spec.block_size))

    # ---- helpers ----------------------------------------------------------------------

    def _new_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id

    def _live(self, *statuses: SeqStatus) -> list[int]:
        return sorted(s for s, seq in self.m.seqs.items() if not statuses or seq.status in statuses)

    def _prompt(self, rnd: random.Random, distinct: bool = False) -> list[int]:
        if distinct:
            return [rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 12))]
        base = list(rnd.choice(TEMPLATES))[:rnd.choice([0, 4, 8, 8])]
        return base + [rnd.randrange(4) for _ in range(rnd.randint(1 if not base else 0, 6))]

    def _new(self, rnd: random.Random, step: StepInput, distinct: bool = False) -> int:
        seq_id = self._new_id()
        eid = rnd.choice(EXECUTORS)
        prompt = self._prompt(rnd, distinct)
        max_total = rnd.choice([0, 0, 0, rnd.randint(len(prompt), 24 + len(prompt))])
        step.new_seqs.append(NewSeq(seq_id, eid, prompt, priority=rnd.randint(0, 3),
                                    cache_salt=rnd.choice(["", "", "", "t1"]), max_total_tokens=max_total,
                                    tenant=rnd.choice(TENANTS), retention_s=rnd.choice([0.0, 0.0, 3.0, 50.0])))
        return seq_id

    def _trim(self, rnd: random.Random, step: StepInput, keep: int = 8) -> list[int]:
        """Finish random sequences beyond `keep` in this step (a gateway's
        requests end): pools turn over instead of silting up. Returns the rest."""
        live = self._live()
        if len(live) > keep:
            gone = rnd.sample(live, len(live) - keep)
            step.free_seq_ids = [*step.free_seq_ids, *gone]
            live = [s for s in live if s not in gone]
        return live

    def _limit(self, spec: ExecutorSpec, max_total: int) -> int:
        limit = spec.num_blocks * spec.block_size
        if spec.max_model_len:
            limit = min(limit, spec.max_model_len)
        return min(limit, max_total) if max_total else limit

    def _schedule(self, rnd: random.Random, step: StepInput, seq_ids, appended: dict[int, list[int]],
                  family: dict[int, int] | None = None) -> None:
        """Schedule seq_ids (live, or children of this step's forks): a token is
        appended first to a computed-up sequence; chunks vary."""
        for seq_id in seq_ids:
            seq = self.m.seqs[(family or {}).get(seq_id, seq_id)]
            n = len(self.tokens.get(seq_id) or seq.token_ids) + len(appended.get(seq_id, ()))
            if seq.status is not SeqStatus.WAITING and n - seq.num_computed < 1:
                if n + 1 > seq.token_limit:
                    continue  # finished: nothing more to compute
                appended.setdefault(seq_id, []).append(rnd.randrange(VOCAB))
            k = rnd.choice([1, 1, 2, 3, 8, 100])
            step.schedule_seq_ids.append(seq_id)
            step.schedule_num_tokens.append(k)

    @staticmethod
    def _set_appended(step: StepInput, appended: dict[int, list[int]]) -> None:
        ids, offs, toks = [], [0], []
        for seq_id, tokens in appended.items():
            ids.append(seq_id)
            toks.extend(tokens)
            offs.append(len(toks))
        step.appended_seq_ids, step.appended_offsets, step.appended_tokens = ids, (offs if ids else []), toks

    def _snapshot(self):
        total, parts = self.m.accounting()
        seqs = {sid: (list(s.token_ids), [b.block_id for b in s.blocks], list(s.swap_blocks), s.status,
                      s.num_computed, s.num_cached_blocks, s.admitted, s.num_cached_tokens)
                for sid, s in self.m.seqs.items()}
        pools = {eid: (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks], sorted(kv.pool.cached),
                       kv.swap.num_free) for eid, kv in self.m.executors.items()}
        return total.as_dict(), [p.as_dict() for p in parts], seqs, pools, len(self.events), self.m.last_step_id

    # ---- running a step -------------------------------------------------------------------

    def _run(self, step: StepInput):
        RULES_RUN[0] += 1
        self.now[0] += 1.0  # pins expire as rules go by
        self.step_id += 1
        step.step_id = self.step_id
        before = {sid: (seq.status, seq.num_computed) for sid, seq in self.m.seqs.items()}
        asked = dict(zip(step.schedule_seq_ids, step.schedule_num_tokens))
        for seq_id, m in zip(step.schedule_seq_ids, step.schedule_lookahead):
            asked[seq_id] += m  # a burst computes its lookahead too
        out = self.m.step(step)
        self.last = (step, out)

        # the gateway's model follows the step: forks, appends, frees, new sequences
        for parent, children in step.forks:
            for child in children:
                self.tokens[child] = list(self.tokens[parent])
                self.salt[child] = self.salt[parent]
                self.limit[child] = self.limit[parent]
        ids, offs, toks = step.appended_seq_ids, step.appended_offsets, step.appended_tokens
        for i, seq_id in enumerate(ids):
            self.tokens[seq_id].extend(toks[offs[i]:offs[i + 1]])
        for seq_id, (samples, _) in self.burst.items():  # the simulated forward feeds them
            self.tokens[seq_id].extend(samples)
        for seq_id in list(step.free_seq_ids) + list(step.abort_seq_ids):
            for d in (self.tokens, self.salt, self.limit):
                del d[seq_id]
            self.freed.append(seq_id)
        rejected = {r.seq_id: r.reason for r in out.rejected}
        for new in step.new_seqs:
            spec = self.specs[new.executor_id]
            limit = spec.max_model_len or spec.num_blocks * spec.block_size
            fits = len(new.prompt_token_ids) <= limit and new.max_total_tokens <= limit
            need = math.ceil(max(len(new.prompt_token_ids), new.max_total_tokens) / spec.block_size)
            never = need > spec.num_blocks
            over_quota = self.quota is not None and need > self.quota.cap(spec.num_blocks)
            expect = None if fits and not never and not over_quota else (
                RejectionReason.OVER_CONTEXT_LIMIT if not fits else RejectionReason.OVER_POOL if never
                else RejectionReason.OVER_QUOTA)
            STATS["over_quota"] += expect is RejectionReason.OVER_QUOTA
            assert rejected.get(new.seq_id) == expect, (new, rejected)
            if expect is None:
                self.tokens[new.seq_id] = list(new.prompt_token_ids)
                self.salt[new.seq_id] = new.cache_salt
                self.limit[new.seq_id] = self._limit(spec, new.max_total_tokens)
        assert set(self.tokens) == set(self.m.seqs)

        # every scheduled sequence is planned, unscheduled or rejected — once
        planned: dict[int, tuple] = {}
        for plan in out.executor_plans:
            kv = self.m.executors[plan.executor_id]
            assert plan.incarnation == kv.spec.incarnation
            for i, seq_id in enumerate(plan.seq_ids):
                assert seq_id not in planned
                planned[seq_id] = (plan, i)
        unscheduled = list(out.unscheduled)
        assert len(set(unscheduled)) == len(unscheduled)
        accounted = set(planned) | set(unscheduled) | {s for s in rejected if s in asked}
        assert accounted == set(asked) and not set(planned) & set(unscheduled)
        # every preemption comes with its decision: the mode, a reason, both estimates
        assert [(d.seq_id, d.mode) for d in out.decisions] == list(out.preempted)
        for d in out.decisions:
            e = d.estimate
            assert d.reason and 0 <= e.recompute_tokens and e.swap_blocks >= 0 and e.freed_blocks <= e.swap_blocks
            if (self.mode == "cost" and e.swap_fits and e.recompute_s is not None and e.swap_s is not None
                    and e.unshare_s is not None):
                STATS["cost_decisions"] += 1
                # a swap costs its copies plus the prefill of the shared blocks it turns private
                swap_cost = e.swap_s + e.unshare_s
                cheaper = PreemptionMode.SWAP if swap_cost < e.recompute_s else PreemptionMode.RECOMPUTE
                assert d.mode is cheaper, d
            if not e.swap_fits:
                assert d.mode is PreemptionMode.RECOMPUTE
        if self.quota is not None:  # no tenant is preempted for another's sake
            requesters = {self.m.seqs[s].tenant for s in asked if s in self.m.seqs}
            for seq_id, _ in out.preempted:
                if seq_id in self.m.seqs:
                    assert self.m.seqs[seq_id].tenant in requesters
        for seq_id, mode in out.preempted:
            status, _ = before.get(seq_id, (SeqStatus.RUNNING, 0))
            assert status is SeqStatus.RUNNING or seq_id in {c for _, cs in step.forks for c in cs}
            assert seq_id not in planned
            if seq_id in self.m.seqs:
                want = SeqStatus.SWAPPED if mode is PreemptionMode.SWAP else SeqStatus.WAITING
                assert self.m.seqs[seq_id].status is want

        # FCFS: after a waiting sequence is not admitted, no later waiting one of
        # that executor is (nor can a preempted one come back in the same step)
        waiting_at_start = {sid for sid, (status, _) in before.items() if status is SeqStatus.WAITING}
        waiting_at_start |= {n.seq_id for n in step.new_seqs if n.seq_id not in rejected}
        waiting_at_start |= {c for p, cs in step.forks for c in cs if p in waiting_at_start}
        closed: set = set()
        for seq_id in step.schedule_seq_ids:
            if seq_id not in waiting_at_start:
                continue
            seq = self.m.seqs[seq_id]
            eid = (seq.executor_id, seq.tenant) if self.quota is not None else seq.executor_id
            if eid in closed:
                assert seq_id in unscheduled, f"waiting {seq_id} overtook an earlier one on {eid}"
            elif seq_id in unscheduled:
                closed.add(eid)

        STATS["preempt_swap"] += sum(1 for _, mode in out.preempted if mode is PreemptionMode.SWAP)
        STATS["preempt_recompute"] += sum(1 for _, mode in out.preempted if mode is PreemptionMode.RECOMPUTE)
        STATS["rejected"] += len(out.rejected)
        STATS["unscheduled"] += len(out.unscheduled)
        for plan in out.executor_plans:
            STATS["cow_copies"] += len(plan.ops.copy_src)
            STATS["swap_ins"] += len(plan.ops.swap_in_src)
            STATS["prefix_hits"] += sum(1 for n in plan.tables.started_cached_tokens if n)

        # the simulated executors run the plans
        for plan in out.executor_plans:
            self._execute(plan, asked)
        return out

    def _execute(self, plan, asked: dict[int, int]) -> None:
        slots = self.slots[plan.executor_id]
        bs = slots.bs
        slots.apply_ops(plan.ops)
        rows = []
        replayed = self.mirrors[plan.executor_id].apply(domain_view(plan))
        for seq_id, q in zip(plan.seq_ids, plan.query_lens):
            r = replayed[seq_id]
            ctx, table, row_slots = r.context_len, r.block_table, r.slots
            seq = self.m.seqs[seq_id]
            assert 1 <= q <= asked[seq_id] and q == r.query_len
            assert table == list(seq.block_ids) == [b.block_id for b in seq.blocks]
            assert seq.num_computed == ctx + q and ctx + q <= len(self.tokens[seq_id])
            assert row_slots == [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q)]
            assert 0 <= r.num_cached_tokens <= ctx
            rows.append((seq_id, ctx, q, table, row_slots))
        written = [s for r in rows for s in r[4]]
        assert len(written) == len(set(written)), "two rows write one slot"
        # the forward: every row writes its new tokens' KV, then reads its whole context;
        # a burst cut short after its sub-step J - 1 wrote nothing real past ctx + J
        ran = {seq_id: j for seq_id, (_, j) in self.burst.items()}
        for seq_id, ctx, q, _, row_slots in rows:
            for i, slot in enumerate(row_slots):
                real = i < ran.get(seq_id, q)
                slots.dev[slot] = kv_of(self.salt[seq_id], self.tokens[seq_id], ctx + i) if real else ("cut", slot)
        for seq_id, ctx, q, table, _ in rows:
            for p in range(ctx + min(q, ran.get(seq_id, q))):
                got = slots.dev.get(table[p // bs] * bs + p % bs)
                assert got == kv_of(self.salt[seq_id], self.tokens[seq_id], p), (seq_id, p, got)

    # ---- rules ----------------------------------------------------------------------------

    @rule(seed=st.integers(0, 2**32 - 1))
    def new_requests(self, seed):
        rnd = random.Random(seed)
        step = StepInput()
        appended: dict[int, list[int]] = {}
        live = self._trim(rnd, step)
        new_ids = [self._new(rnd, step) for _ in range(rnd.randint(1, 3))]
        others = rnd.sample(live, min(len(live), rnd.randint(0, 3)))
        for seq_id in new_ids:
            step.schedule_seq_ids.append(seq_id)
            step.schedule_num_tokens.append(rnd.choice([1, 3, 100, 100]))
        self._schedule(rnd, step, others, appended)
        order = list(zip(step.schedule_seq_ids, step.schedule_num_tokens))
        rnd.shuffle(order)
        step.schedule_seq_ids, step.schedule_num_tokens = [s for s, _ in order], [k for _, k in order]
        self._set_appended(step, appended)
        self._run(step)

    @precondition(lambda self: self.m.seqs)
    @rule(seed=st.integers(0, 2**32 - 1))
    def decode(self, seed):
        """Append + schedule a random subset in random order (decodes, chunked
        prefills, re-admissions, swap-ins)."""
        rnd = random.Random(seed)
        step = StepInput()
        appended: dict[int, list[int]] = {}
        live = self._live()
        chosen = rnd.sample(live, rnd.randint(1, len(live)))
        self._schedule(rnd, step, chosen, appended)
        self._set_appended(step, appended)
        self._run(step)

    @precondition(lambda self: self._live(SeqStatus.RUNNING))
    @rule(seed=st.integers(0, 2**32 - 1))
    def plain_decode(self, seed):
        """What a serving loop sends most: one token appended to and scheduled for
        running sequences, nothing else (the manager's decode fast path, with its
        hand-over to the general loop when the pool is short)."""
        rnd = random.Random(seed)
        running = [s for s in self._live(SeqStatus.RUNNING)
                   if len(self.tokens[s]) < self.m.seqs[s].token_limit or
                   len(self.tokens[s]) > self.m.seqs[s].num_computed]
        if not running:
            return self.decode(seed)
        chosen = rnd.sample(running, rnd.randint(1, len(running)))
        appended = {s: [rnd.randrange(VOCAB)] for s in chosen if len(self.tokens[s]) == self.m.seqs[s].num_computed}
        step = StepInput(schedule_seq_ids=chosen, schedule_num_tokens=[1] * len(chosen))
        self._set_appended(step, appended)
        if self.m.validator.check_decode(step) is not None:
            STATS["fast_decodes"] += 1
        self._run(step)

    @precondition(lambda self: self._live(SeqStatus.RUNNING))
    @rule(seed=st.integers(0, 2**32 - 1))
    def burst_cut_short(self, seed):
        """A decode burst (a lookahead of m) whose executor ran only J <= m of
        its m + 1 sub-steps (a step waited behind it): K/V past them is
        garbage. The next Step appends the J samples and cuts it; what stays
        computed must be real, and no block the prefix index offers may hold
        the garbage."""
        rnd = random.Random(seed)
        ready = [s for s in self._live(SeqStatus.RUNNING)
                 if len(self.tokens[s]) == self.m.seqs[s].num_computed
                 and len(self.tokens[s]) + 2 <= self.m.seqs[s].token_limit]
        if not ready:
            return self.decode(seed)
        s = rnd.choice(ready)
        seq = self.m.seqs[s]
        ctx = len(self.tokens[s])
        m = rnd.randint(1, min(6, seq.token_limit - ctx - 1))
        samples, ran = [rnd.randrange(VOCAB) for _ in range(m)], rnd.randint(1, m)
        step = StepInput(schedule_seq_ids=[s], schedule_num_tokens=[1], schedule_lookahead=[m])
        self._set_appended(step, {s: [rnd.randrange(VOCAB)]})
        self.burst = {s: (samples, ran)}
        try:
            self._run(step)
        finally:
            self.burst = {}
        del self.tokens[s][ctx + 1:]  # what it sampled comes with the next Step
        if s not in self.m.seqs or seq.status is not SeqStatus.RUNNING or seq.num_pending != m:
            return  # not granted (no room): no burst
        mirror = self.mirrors[seq.executor_id]  # the executor counts what ran, its table only the blocks it fills
        mirror.computed[s] -= m + 1 - ran
        mirror.tables[s] = mirror.tables[s][:math.ceil(mirror.computed[s] / mirror.block_size)]
        cut = StepInput(cut_seq_ids=[s])
        self._set_appended(cut, {s: samples[:ran]})
        self._run(cut)
        assert seq.num_pending == 0 and seq.num_computed == ctx + ran and len(seq.token_ids) == ctx + 1 + ran
        STATS["cut_bursts"] += 1

    @precondition(lambda self: self._live(SeqStatus.RUNNING, SeqStatus.WAITING))
    @rule(seed=st.integers(0, 2**32 - 1))
    def fork_and_diverge(self, seed):
        """Fork a sequence; in the same step every member gets its own token."""
        rnd = random.Random(seed)
        parent = rnd.choice(self._live(SeqStatus.RUNNING, SeqStatus.WAITING))
        children = [self._new_id() for _ in range(rnd.randint(1, 2))]
        step = StepInput(forks=[(parent, children)])
        family = {c: parent for c in children}
        seq = self.m.seqs[parent]
        appended: dict[int, list[int]] = {}
        members = [parent, *children]
        rnd.shuffle(members)
        if seq.status is SeqStatus.RUNNING and len(self.tokens[parent]) + 1 <= seq.token_limit:
            tokens = rnd.sample(range(VOCAB), len(members))
            for member, tok in zip(members, tokens):
                appended[member] = [tok]
        if rnd.random() < 0.6:
            # some members may be scheduled later; others (swapped ones too) interleave
            others = [s for s in self._live() if s != parent]
            chosen = [*rnd.sample(members, rnd.randint(1, len(members))),
                      *rnd.sample(others, min(len(others), rnd.randint(0, 3)))]
            rnd.shuffle(chosen)
            self._schedule(rnd, step, chosen, appended, family)
        self._set_appended(step, appended)
        self._run(step)

    def _sharing_writers(self) -> list[int]:
        """Running sequences whose next write lands in a block others hold too."""
        out = []
        for sid, seq in self.m.seqs.items():
            if seq.status is SeqStatus.RUNNING:
                i = seq.num_computed // self.specs[seq.executor_id].block_size
                if i < len(seq.blocks) and seq.blocks[i].ref_cnt > 1:
                    out.append(sid)
        return sorted(out)

    @precondition(lambda self: self.m.seqs and self._sharing_writers())
    @rule(seed=st.integers(0, 2**32 - 1))
    def copy_then_preempt(self, seed):
        """Copy-on-writes first, then sequences that grow (and may preempt a copy
        source's other holders), then swap-ins, in one step: a copy source must
        hold its KV until the copies ran."""
        rnd = random.Random(seed)
        writers = self._sharing_writers()
        rest = [s for s in self._live(SeqStatus.RUNNING) if s not in writers]
        swapped = sorted(self._live(SeqStatus.SWAPPED), key=lambda s: self.m.seqs[s].priority)
        chosen = [*rnd.sample(writers, rnd.randint(1, len(writers))),
                  *rnd.sample(rest, min(len(rest), rnd.randint(0, 2))), *swapped]
        step = StepInput()
        appended: dict[int, list[int]] = {}
        self._schedule(rnd, step, chosen, appended)
        self._set_appended(step, appended)
        self._run(step)

    @precondition(lambda self: self.m.seqs)
    @rule(seed=st.integers(0, 2**32 - 1), abort=st.booleans())
    def finish(self, seed, abort):
        rnd = random.Random(seed)
        live = self._live()
        gone = rnd.sample(live, min(len(live), rnd.randint(1, 2)))
        step = StepInput(abort_seq_ids=gone) if abort else StepInput(free_seq_ids=gone)
        rest = [s for s in live if s not in gone]
        appended: dict[int, list[int]] = {}
        self._schedule(rnd, step, rnd.sample(rest, min(len(rest), rnd.randint(0, 2))), appended)
        self._set_appended(step, appended)
        self._run(step)

    @rule(seed=st.integers(0, 2**32 - 1))
    def flood(self, seed):
        """Many distinct prompts at once: eviction, preemption, rejections."""
        rnd = random.Random(seed)
        step = StepInput()
        self._trim(rnd, step, keep=4)
        for _ in range(rnd.randint(3, 6)):
            seq_id = self._new(rnd, step, distinct=True)
            step.schedule_seq_ids.append(seq_id)
            step.schedule_num_tokens.append(100)
        self._run(step)

    @rule(seed=st.integers(0, 2**32 - 1))
    def reregister(self, seed):
        """An executor restarts (one time in five; else a decode step, so that
        sequences live long enough to be preempted and swapped back)."""
        rnd = random.Random(seed)
        if rnd.random() >= 0.2:
            if self.m.seqs:
                self.decode(seed)
            return
        RULES_RUN[0] += 1
        eid = rnd.choice(EXECUTORS)
        old = self.specs[eid]
        spec = ExecutorSpec(eid, num_blocks=max(2, old.num_blocks + rnd.choice([-1, 0, 1])),
                            block_size=old.block_size, num_swap_blocks=rnd.randint(0, 6), model_id="m",
                            dtype="float32", incarnation=old.incarnation + 1, pool_generation=1,
                            max_model_len=old.max_model_len, vocab_size=VOCAB)
        dropped = [s for s, seq in self.m.seqs.items() if seq.executor_id == eid]
        self._register(spec)
        STATS["reregistrations"] += 1
        for seq_id in dropped:
            for d in (self.tokens, self.salt, self.limit):
                del d[seq_id]
            self.freed.append(seq_id)
        assert not any(seq.executor_id == eid for seq in self.m.seqs.values())
        assert self.m.executors[eid].pool.cached == {}

    @rule(seed=st.integers(0, 2**32 - 1), case=st.integers(0, 11))
    def bad_step(self, seed, case):
        """A step with one malformed part next to valid ones changes nothing."""
        RULES_RUN[0] += 1
        rnd = random.Random(seed)
        step = StepInput(step_id=self.step_id + 1)
        live = self._live()
        appended: dict[int, list[int]] = {}
        self._new(rnd, step)
        if live:
            step.free_seq_ids = [rnd.choice(live)]
        rest = [s for s in live if s not in step.free_seq_ids]
        self._schedule(rnd, step, rnd.sample(rest, min(len(rest), 2)), appended)
        swapped = self._live(SeqStatus.SWAPPED)
        done = [s for s in self._live(SeqStatus.RUNNING)
                if s not in appended and self.m.seqs[s].num_computed == len(self.tokens[s])]
        if case == 0:
            step.free_seq_ids = [*step.free_seq_ids, 10**9]
        elif case == 1 and self.freed:
            step.abort_seq_ids = [rnd.choice(self.freed)]
        elif case == 2:
            step.new_seqs.append(NewSeq(self._new_id(), "e0", [1, -1]))
        elif case == 3:
            step.new_seqs.append(NewSeq(self._new_id(), "e1", [1, VOCAB]))
        elif case == 4:
            step.schedule_seq_ids.append(step.new_seqs[0].seq_id)
            step.schedule_num_tokens.append(rnd.choice([0, -3]))
        elif case == 5:
            step.schedule_seq_ids.append(step.new_seqs[0].seq_id)
            step.schedule_seq_ids.append(step.new_seqs[0].seq_id)
            step.schedule_num_tokens.extend([1, 1])
        elif case == 6:
            step.schedule_num_tokens.append(1)  # one more count than ids
        elif case == 7 and swapped:
            step.forks = [(rnd.choice(swapped), [self._new_id()])]
        elif case == 8 and rest:
            step.new_seqs.append(NewSeq(rnd.choice(rest), "e0", [1]))
        elif case == 9 and rest:
            victim = rnd.choice(rest)
            appended[victim] = appended.get(victim, []) + [1] * (self.limit[victim] + 1)
        elif case == 10 and done:
            step.schedule_seq_ids.append(rnd.choice(done))
            step.schedule_num_tokens.append(1)
        elif case == 11 and rest:
            victim = rnd.choice(rest)
            appended[victim] = appended.get(victim, []) + [VOCAB]
        else:
            appended[10**9] = [1]
        self._set_appended(step, appended)
        before = self._snapshot()
        with pytest.raises(KvpagerError):
            self.m.step(step)
        assert self._snapshot() == before
        STATS["bad_steps"] += 1

    @precondition(lambda self: self.last is not None)
    @rule(seed=st.integers(0, 2**32 - 1))
    def retry_last_step(self, seed):
        """The last step again (a client retry): the same plan, nothing applied
        twice. Then a decode step."""
        step, out = self.last
        before = self._snapshot()
        assert self.m.step(step) is out
        assert self._snapshot() == before
        STATS["retries"] += 1
        if self.m.seqs:
            self.decode(seed)
        else:
            RULES_RUN[0] += 1

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def sound(self):
        if self.m is None:
            return
        assert self.m.check_invariants() == []
        for sid, seq in self.m.seqs.items():
            assert seq.token_ids == self.tokens[sid]
        self._check_kv_intact()
        self._check_index_mirror()
        self._check_accounting()
        self._check_tenants_and_pins()

    def _check_kv_intact(self) -> None:
        """Every live sequence's computed KV is still where its table says."""
        for sid, seq in self.m.seqs.items():
            slots = self.slots[seq.executor_id]
            bs = slots.bs
            if seq.status is SeqStatus.RUNNING:
                where, store = [b.block_id for b in seq.blocks], slots.dev
            elif seq.status is SeqStatus.SWAPPED:
                where, store = seq.swap_blocks, slots.cpu
            else:
                assert seq.num_computed == 0 and not seq.blocks and not seq.swap_blocks
                continue
            for p in range(seq.num_computed):
                got = store.get(where[p // bs] * bs + p % bs)
                assert got == kv_of(self.salt[sid], self.tokens[sid], p), (sid, seq.status, p, got)

    def _check_index_mirror(self) -> None:
        for event in self.events.drain():
            index = self.index.setdefault(event.executor_id, {})
            if isinstance(event, BlockStored):
                assert event.block_hash not in index
                index[event.block_hash] = event.block_id
            elif isinstance(event, BlockRemoved):
                STATS["evictions"] += 1
                assert index.pop(event.block_hash) == event.block_id
            else:
                assert isinstance(event, AllCleared)
                index.clear()
        for eid, kv in self.m.executors.items():
            assert self.index.get(eid, {}) == {h: b.block_id for h, b in kv.pool.cached.items()}

    def _check_accounting(self) -> None:
        total, parts = self.m.accounting()
        for part in parts:
            kv = self.m.executors[part.executor_id]
            bs = kv.block_size
            running = sum(1 for s in kv.seq_ids if self.m.seqs[s].status is SeqStatus.RUNNING)
            assert part.used_blocks + part.free_blocks == part.total_blocks == kv.spec.num_blocks
            assert part.physical_blocks == part.used_blocks  # every used block is in some table
            assert part.sharing_saved_blocks == part.logical_blocks - part.physical_blocks >= 0
            assert part.allocated_slots == part.used_blocks * bs
            # internal waste: at most one partial block per running sequence
            assert 0 <= part.allocated_slots - part.live_tokens <= (bs - 1) * running
            assert part.num_sequences == running
            max_len = kv.spec.max_model_len or kv.spec.num_blocks * bs
            assert part.contiguous_equivalent_blocks == running * -(-max_len // bs)
            assert 0 <= part.prefix_hit_tokens <= part.prefix_query_tokens
            assert part.swap_free_blocks + sum(len(self.m.seqs[s].swap_blocks) for s in kv.seq_ids) \
                == part.swap_total_blocks
        assert total.used_blocks == sum(p.used_blocks for p in parts)
        for part in parts:
            kv = self.m.executors[part.executor_id]
            assert part.block_usage == part.used_blocks / part.total_blocks
            assert part.token_occupancy == part.live_tokens / (part.total_blocks * kv.block_size) <= 1
            assert 0 <= part.recompute_hit_tokens <= part.recompute_query_tokens
            assert part.contiguous_declared_blocks <= part.contiguous_equivalent_blocks
            assert part.preempt_cost_s >= 0
            if self.mode == "cost":
                assert part.preempt_saved_s >= -1e-9  # the cheaper mode, every time both were priced

    def _check_tenants_and_pins(self) -> None:
        retention = self.m.retention
        for eid, kv in self.m.executors.items():
            tenants = {self.m.seqs[s].tenant for s in kv.seq_ids}
            if self.quota is not None:
                for t in tenants:
                    assert len(tenant_blocks(kv, self.m.seqs, t)) <= self.quota.cap(kv.spec.num_blocks), t
            queues = getattr(kv.pool.free_queue, "queues", None)
            if queues is not None:  # retention on: tier 1 holds only blocks that were pinned when freed
                assert all(b.retain_until > 0 and b.block_hash is not None for b in queues[1].iter_newest())
            for t in TENANTS:
                pins = retention.pinned(eid, t)
                STATS["pins"] += len(pins)
                if retention.quota is None:
                    assert not pins
                else:
                    assert len(pins) <= retention.quota.cap(kv.spec.num_blocks)
                assert all(b.block_hash is not None and b.retain_until > self.now[0] for b in pins)


def test_memory_manager_state_machine():
    start = RULES_RUN[0]
    stats_before = dict(STATS)

    def run(examples: int) -> None:
        run_state_machine_as_test(MemoryMachine, settings=settings(
            max_examples=examples, stateful_step_count=STEPS, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))

    def seen() -> dict[str, int]:
        return {k: v - stats_before[k] for k, v in STATS.items()}

    run(EXAMPLES)
    ran = RULES_RUN[0] - start
    print(f"\nstateful: {ran} rules over {EXAMPLES} examples; {seen()}")
    assert ran >= EXAMPLES * 100, "fewer random operations than promised (100 per example)"
    if EXAMPLES >= 20:  # a degenerate machine that stopped exercising something fails here
        # Rare events (a cost-model decision needs the cost mode, a preemption
        # and a swap that fits) may miss one random draw: a few more examples
        # top the coverage up; a machine that never reaches one still fails.
        for _ in range(3):
            if all(seen().values()):
                break
            run(EXAMPLES // 4)
            print(f"stateful: topped up; {seen()}")
        assert all(seen().values()), seen()
