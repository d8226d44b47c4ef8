"""The memory manager: every executor's pool and every sequence, one Step at a time.

A Step is validated completely before anything changes (all-or-nothing),
then applied in a fixed order: forks, appended tokens, frees, aborts, new
sequences, schedule. Forks come first so that one step can fork a sequence
and give each child its own sampled token (n > 1, beam search), and frees
after appends so a pruned beam's parent can be forked and freed at once. Scheduling allocates in the caller's order; when a
sequence cannot get room the victim policy picks whom to preempt and the
mode policy how. Allocation for one sequence either succeeds or that
sequence is not scheduled: failure never leaves partial state.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable

from kvpager.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from memory_service.accounting import PoolAccounting, check_invariants, executor_accounting, total_accounting
from memory_service.block import Block
from memory_service.events import EventQueue
from memory_service.kv_manager import ExecutorKV, ExecutorSpec
from memory_service.policy import ModePolicy, PreemptionMode, VictimPolicy
from kvpager.prefix_index.hashing import namespace_digest, root_hash
from memory_service.records import (ExecutorStepPlan, NewSeq, PrefixScore, Rejected, RejectionReason, StepInput,
                                    StepOutput)
from kvpager.seq_status import SeqStatus
from memory_service.sequence import Sequence

# Token ids are hashed as uint32: the bound when an executor registers no vocabulary.
_MAX_TOKEN_ID = 2**32 - 1


def _vocab_bound(kv: ExecutorKV) -> int:
    """Token ids of kv's sequences must be below this."""
    return kv.spec.vocab_size or _MAX_TOKEN_ID + 1


# How many freed sequence ids are remembered, to tell a double free
# (FAILED_PRECONDITION) from an id that never existed (NOT_FOUND).
_TOMBSTONES = 65536


class MemoryManager:
    def __init__(self, victim_policy: VictimPolicy | None = None, mode_policy: ModePolicy | None = None,
                 events: EventQueue | None = None) -> None:
        self.victim_policy = victim_policy or VictimPolicy()
        self.mode_policy = mode_policy or ModePolicy()
        self.events = events if events is not None else EventQueue()
        self.executors: dict[str, ExecutorKV] = {}
        self.seqs: dict[int, Sequence] = {}
        self._namespaces: dict[str, bytes] = {}
        self._freed: OrderedDict[int, None] = OrderedDict()
        self._arrivals = itertools.count()
        self.last_step_id = 0
        self._last_output: StepOutput | None = None

    # ---- executors ------------------------------------------------------------

    def register_executor(self, spec: ExecutorSpec) -> bool:
        """Add (or replace) an executor's pool. Returns True when an earlier
        incarnation was dropped together with its sequences."""
        if spec.num_blocks <= 0 or spec.block_size <= 0 or spec.num_swap_blocks < 0:
            raise InvalidArgument("num_blocks and block_size must be positive, num_swap_blocks >= 0")
        if not spec.executor_id:
            raise InvalidArgument("executor_id must not be empty")
        old = self.executors.get(spec.executor_id)
        if old is not None:
            same = (old.spec.incarnation == spec.incarnation and old.spec.pool_generation == spec.pool_generation
                    and old.spec.num_blocks == spec.num_blocks and old.spec.block_size == spec.block_size)
            if same:
                old.spec.address = spec.address or old.spec.address
                return False
            self._drop_executor(old)
        self.executors[spec.executor_id] = ExecutorKV(spec, self.events)
        self._namespaces[spec.executor_id] = namespace_digest(spec.model_id, spec.block_size, spec.dtype,
                                                              spec.adapter)
        return old is not None

    def deregister_executor(self, executor_id: str, incarnation: int = 0) -> int:
        kv = self._executor(executor_id)
        if incarnation and kv.spec.incarnation != incarnation:
            raise FailedPrecondition(f"executor {executor_id!r} is at incarnation {kv.spec.incarnation}, "
                                     f"not {incarnation}")
        dropped = self._drop_executor(kv)
        del self.executors[executor_id]
        return dropped

    def _drop_executor(self, kv: ExecutorKV) -> int:
        ids = list(kv.seq_ids)
        for seq_id in ids:
            seq = self.seqs.pop(seq_id)
            kv.release(seq)
            self._remember_freed(seq_id)
        kv.seq_ids.clear()
        kv.pool.clear()
        return len(ids)

    def _executor(self, executor_id: str) -> ExecutorKV:
        kv = self.executors.get(executor_id)
        if kv is None:
            raise NotFound(f"unknown executor {executor_id!r}")
        return kv

    # ---- validation -----------------------------------------------------------

    def _remember_freed(self, seq_id: int) -> None:
        self._freed[seq_id] = None
        if len(self._freed) > _TOMBSTONES:
            self._freed.popitem(last=False)

    def _missing(self, seq_id: int, what: str) -> Exception:
        if seq_id in self._freed:
            return FailedPrecondition(f"{what}: sequence {seq_id} was already freed")
        return NotFound(f"{what}: unknown sequence {seq_id}")

    def _validate(self, step: StepInput) -> None:
        """Raise a domain error for anything malformed; changes nothing."""
        live = self.seqs
        created: dict[int, int] = {}  # children of this step's forks -> parent
        gone: set[int] = set()      # freed/aborted in this step

        def alive(seq_id: int) -> bool:
            return (seq_id in live or seq_id in created) and seq_id not in gone

        for parent_id, children in step.forks:
            if not alive(parent_id):
                raise self._missing(parent_id, "fork")
            parent = live.get(parent_id)
            if parent is not None and parent.status is SeqStatus.SWAPPED:
                raise FailedPrecondition(f"fork: sequence {parent_id} is swapped out")
            if not children:
                raise InvalidArgument("fork: no child sequence ids")
            for child in children:
                if alive(child) or child in created:
                    raise AlreadyExists(f"fork: sequence {child} already exists")
                created[child] = parent_id
        ids, offs, toks = step.appended_seq_ids, step.appended_offsets, step.appended_tokens
        if ids or toks or len(offs) > 1:
            if len(offs) != len(ids) + 1 or offs[0] != 0 or offs[-1] != len(toks):
                raise InvalidArgument("appended: offsets must have one more entry than seq_ids and span the tokens")
            if len(set(ids)) != len(ids):
                raise InvalidArgument("appended: a sequence appears twice")
            for i, seq_id in enumerate(ids):
                seq = live.get(seq_id)  # frees come later: nothing is gone yet
                if seq is None:
                    if seq_id not in created:
                        raise self._missing(seq_id, "appended")
                    seq = live[self._origin(seq_id, created)]
                n = offs[i + 1] - offs[i]
                if n < 0:
                    raise InvalidArgument("appended: offsets must not decrease")
                if len(seq.token_ids) + n > seq.token_limit:
                    raise InvalidArgument(f"appended: sequence {seq_id} would hold {seq.num_tokens + n} tokens, "
                                          f"over its limit of {seq.token_limit}")
            if toks and min(toks) < 0:
                raise InvalidArgument("appended: token ids must be >= 0")
            if toks and max(toks) >= min(map(_vocab_bound, self.executors.values()), default=_MAX_TOKEN_ID + 1):
                for i, seq_id in enumerate(ids):  # rare: find whose vocabulary it leaves
                    chunk = toks[offs[i]:offs[i + 1]]
                    seq = live[self._origin(seq_id, created)]
                    bound = _vocab_bound(self.executors[seq.executor_id])
                    if chunk and max(chunk) >= bound:
                        raise InvalidArgument(f"appended: sequence {seq_id}: token id {max(chunk)} outside the "
                                              f"vocabulary ({bound})")
        for what, seq_ids in (("free", step.free_seq_ids), ("abort", step.abort_seq_ids)):
            for seq_id in seq_ids:
                if seq_id in gone:
                    raise FailedPrecondition(f"{what}: sequence {seq_id} is freed twice in one step")
                if not alive(seq_id):
                    raise self._missing(seq_id, what)
                gone.add(seq_id)
        new_ids = set()
        for new in step.new_seqs:
            if new.seq_id in new_ids or alive(new.seq_id):
                raise AlreadyExists(f"new sequence {new.seq_id} already exists")
            new_ids.add(new.seq_id)
            kv = self._executor(new.executor_id)
            if len(new.prompt_token_ids) == 0:
                raise InvalidArgument(f"new sequence {new.seq_id}: empty prompt")
            if min(new.prompt_token_ids) < 0:
                raise InvalidArgument(f"new sequence {new.seq_id}: token ids must be >= 0")
            vocab = _vocab_bound(kv)
            if max(new.prompt_token_ids) >= vocab:
                raise InvalidArgument(f"new sequence {new.seq_id}: token id {max(new.prompt_token_ids)} "
                                      f"outside the vocabulary ({vocab})")
            if new.max_total_tokens < 0:
                raise InvalidArgument(f"new sequence {new.seq_id}: max_total_tokens must be >= 0")
            if new.prompt_block_hashes is not None and \
                    len(new.prompt_block_hashes) > len(new.prompt_token_ids) // kv.block_size:
                raise InvalidArgument(f"new sequence {new.seq_id}: {len(new.prompt_block_hashes)} prompt block "
                                      f"hashes for {len(new.prompt_token_ids) // kv.block_size} full blocks")
            if new.max_total_tokens and new.max_total_tokens < len(new.prompt_token_ids):
                raise InvalidArgument(f"new sequence {new.seq_id}: max_total_tokens {new.max_total_tokens} is "
                                      f"shorter than its prompt ({len(new.prompt_token_ids)} tokens)")
        sids, nums = step.schedule_seq_ids, step.schedule_num_tokens
        if len(sids) != len(nums):
            raise InvalidArgument("schedule: seq_ids and num_tokens differ in length")
        if len(set(sids)) != len(sids):
            raise InvalidArgument("schedule: a sequence appears twice")
        if nums and min(nums) < 1:
            raise InvalidArgument("schedule: num_tokens must be >= 1")
        appended = {seq_id: offs[i + 1] - offs[i] for i, seq_id in enumerate(ids)} if ids else {}
        waiting = SeqStatus.WAITING
        for seq_id in sids:
            base = live.get(seq_id)
            if base is None or seq_id in gone or seq_id in created:
                if seq_id in new_ids:
                    continue
                if not alive(seq_id):
                    raise self._missing(seq_id, "schedule")
                base = live[self._origin(seq_id, created)]
            if base.status is not waiting:
                remaining = base.num_tokens + appended.get(seq_id, 0) - base.num_computed
                if remaining < 1:
                    raise InvalidArgument(f"schedule: sequence {seq_id} has no token left to compute "
                                          "(append the sampled token first)")

    def _origin(self, seq_id: int, created: dict[int, int]) -> int:
        """The live sequence whose tokens seq_id holds before this step's appends
        (itself, or the ancestor a fork in this step copied)."""
        while seq_id not in self.seqs:
            seq_id = created[seq_id]
        return seq_id

    def _token_limit(self, seq: Sequence) -> int:
        spec = self.executors[seq.executor_id].spec
        limit = spec.num_blocks * spec.block_size
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
            raise FailedPrecondition(f"step {step.step_id} is older than the last step {self.last_step_id}")
        self._validate(step)
        out = StepOutput(step.step_id)

        for parent_id, children in step.forks:
            self._fork(parent_id, children)
        ids, offs, toks = step.appended_seq_ids, step.appended_offsets, step.appended_tokens
        for i, seq_id in enumerate(ids):
            self.seqs[seq_id].token_ids.extend(toks[offs[i]:offs[i + 1]])
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
        self._schedule(step, out, rejected)
        if step.step_id:
            self.last_step_id = step.step_id
            self._last_output = out
        return out

    def _create(self, new: NewSeq) -> Rejected | None:
        kv = self.executors[new.executor_id]
        n = len(new.prompt_token_ids)
        limit = kv.spec.max_model_len or kv.spec.num_blocks * kv.spec.block_size
        if n >= limit + 1 or (new.max_total_tokens and new.max_total_tokens > limit):
            return Rejected(new.seq_id, RejectionReason.OVER_CONTEXT_LIMIT,
                            f"sequence needs {max(n, new.max_total_tokens)} tokens, over the context limit {limit}")
        if not kv.can_ever_fit(max(n, new.max_total_tokens)):
            return Rejected(new.seq_id, RejectionReason.OVER_POOL,
                            f"sequence needs {max(n, new.max_total_tokens)} tokens; executor {kv.spec.executor_id!r} "
                            f"holds {kv.spec.num_blocks * kv.spec.block_size} in all")
        seq = Sequence(new.seq_id, new.executor_id, list(new.prompt_token_ids),
                       root_hash(self._namespaces[new.executor_id], new.cache_salt),
                       priority=new.priority, arrival=next(self._arrivals),
                       max_total_tokens=new.max_total_tokens, num_prompt_tokens=n)
        seq.token_limit = self._token_limit(seq)
        if new.prompt_block_hashes:
            seq.block_hashes = list(new.prompt_block_hashes)  # computed once, by the router
        self.seqs[new.seq_id] = seq
        kv.seq_ids.add(new.seq_id)
        self._freed.pop(new.seq_id, None)
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
                             num_prompt_tokens=parent.num_prompt_tokens, token_limit=parent.token_limit)
            shared += kv.fork(parent, child)
            self.seqs[child_id] = child
            kv.seq_ids.add(child_id)
            self._freed.pop(child_id, None)
        return shared

    def _free(self, seq_id: int) -> int:
        seq = self.seqs.pop(seq_id)
        kv = self.executors[seq.executor_id]
        kv.seq_ids.discard(seq_id)
        self._remember_freed(seq_id)
        return kv.release(seq)

    def _schedule(self, step: StepInput, out: StepOutput, rejected: set[int]) -> None:
        seqs = self.seqs
        done: set[int] = set()          # handled in this step (scheduled or given up)
        preempted: set[int] = set()
        admission_closed: set[str] = set()
        # executor -> (seq, start, k, prefix hit reported: on the first admission only)
        plans: dict[str, list[tuple[Sequence, int, int, int]]] = {}

        executors = self.executors
        running = SeqStatus.RUNNING
        kv = None
        rows = None
        for seq_id, k in zip(step.schedule_seq_ids, step.schedule_num_tokens):
            if seq_id in rejected:
                continue
            seq = seqs[seq_id]
            done.add(seq_id)
            if preempted and seq_id in preempted:
                out.unscheduled.append(seq_id)
                continue
            if kv is None or kv.spec.executor_id != seq.executor_id:
                kv = executors[seq.executor_id]
                rows = plans.setdefault(seq.executor_id, [])
            status = seq.status
            if status is running:
                start = seq.num_computed
                remaining = len(seq.token_ids) - start  # >= 1, validated
                if k > remaining:
                    k = remaining
                if kv.allocate_slots(seq, k):  # the common case: no preemption
                    rows.append((seq, start, k, 0))
                    kv.commit(seq, k)
                    continue
                while not kv.allocate_slots(seq, k):
                    victim = self.victim_policy.select(
                        [s for s in (seqs[i] for i in kv.seq_ids)
                         if s.status is SeqStatus.RUNNING and (s.seq_id not in done or s is seq)])
                    self._preempt(victim, kv, out, preempted)
                    if victim is seq:
                        break
                else:
                    plans.setdefault(kv.spec.executor_id, []).append((seq, start, k, 0))
                    kv.commit(seq, k)
                    continue
                out.unscheduled.append(seq_id)
            elif status is SeqStatus.SWAPPED:
                k = min(k, seq.num_tokens - seq.num_computed)
                if self._with_room(kv, seq, k, done, out, preempted, lambda: kv.swap_in(seq, k)):
                    plans.setdefault(kv.spec.executor_id, []).append((seq, seq.num_computed, k, 0))
                    kv.commit(seq, k)
                else:
                    out.unscheduled.append(seq_id)
            else:  # WAITING: new, or preempted by recompute
                if kv.spec.executor_id in admission_closed:
                    out.unscheduled.append(seq_id)  # FCFS: no overtaking a request that did not fit
                    continue
                first = not seq.admitted
                result: list = []

                def admit() -> bool:
                    r = kv.admit(seq, k, count_hits=first)
                    if r is None:
                        return False
                    result.append(r)
                    return True

                if self._with_room(kv, seq, k, done, out, preempted, admit):
                    num_hit, granted = result[0]
                    if first:
                        seq.admitted = True
                        seq.num_cached_tokens = num_hit
                    plans.setdefault(kv.spec.executor_id, []).append((seq, num_hit, granted, num_hit if first else 0))
                    kv.commit(seq, granted)
                else:
                    out.unscheduled.append(seq_id)
                    admission_closed.add(kv.spec.executor_id)

        for executor_id, kv in self.executors.items():
            rows = plans.get(executor_id)
            ops = kv.take_ops()
            if not rows and not ops:
                continue
            out.executor_plans.append(self._build_plan(kv, rows or [], ops))

    def _with_room(self, kv: ExecutorKV, seq: Sequence, k: int, done: set[int], out: StepOutput,
                   preempted: set[int], attempt) -> bool:
        """Run attempt(); while it fails, preempt running sequences strictly less
        important than seq (equal priorities never preempt for admission, so the
        pool cannot thrash)."""
        if attempt():
            return True
        need, hits = kv.room_needed(seq, k)
        reused = set(hits)
        while True:
            candidates = [s for s in (self.seqs[i] for i in kv.seq_ids)
                          if s.status is SeqStatus.RUNNING and s.seq_id not in done and s.priority > seq.priority]
            if not candidates:
                return False
            # Preempt only when preempting every candidate could make room, so no
            # one loses its blocks for nothing: count the blocks only candidates
            # hold, less the cached hits the attempt takes back itself.
            holders: dict[Block, int] = {}
            for s in candidates:
                for b in s.blocks:
                    holders[b] = holders.get(b, 0) + 1
            reclaimable = sum(1 for b, n in holders.items() if n == b.ref_cnt and b not in reused)
            free = kv.pool.num_free - sum(1 for b in hits if b.ref_cnt == 0)
            if free + reclaimable < need:
                return False
            self._preempt(self.victim_policy.select(candidates), kv, out, preempted)
            if attempt():
                return True

    def _preempt(self, victim: Sequence, kv: ExecutorKV, out: StepOutput, preempted: set[int]) -> None:
        mode = self.mode_policy.choose(victim, kv.swap.num_free)
        if mode is PreemptionMode.SWAP:
            kv.preempt_swap(victim)
        else:
            kv.preempt_recompute(victim)
        preempted.add(victim.seq_id)
        out.preempted.append((victim.seq_id, mode))

    def _build_plan(self, kv: ExecutorKV, rows: list[tuple[Sequence, int, int, int]], ops) -> ExecutorStepPlan:
        plan = ExecutorStepPlan(kv.spec.executor_id, kv.spec.incarnation, ops=ops)
        bs = kv.block_size
        seq_ids, ctx, qlen = plan.seq_ids, plan.context_lens, plan.query_lens
        offsets, tables, slots, cached = (plan.block_table_offsets, plan.block_tables, plan.slot_mapping,
                                          plan.num_cached_tokens)
        total = 0
        for seq, start, k, num_cached in rows:
            seq_ids.append(seq.seq_id)
            ctx.append(start)
            qlen.append(k)
            cached.append(num_cached)
            ids = seq.block_ids
            tables.extend(ids)
            total += len(ids)
            offsets.append(total)
            if k == 1:  # decode
                slots.append(ids[start // bs] * bs + start % bs)
                continue
            blocks = seq.blocks
            end = start + k
            pos = start
            while pos < end:  # one range per block touched
                i, off = divmod(pos, bs)
                n = min(bs - off, end - pos)
                base = blocks[i].block_id * bs + off
                slots.extend(range(base, base + n))
                pos += n
        return plan

    # ---- stand-alone operations ---------------------------------------------------

    def fork(self, parent_id: int, child_ids: list[int]) -> int:
        self._validate(StepInput(forks=[(parent_id, child_ids)]))
        return self._fork(parent_id, child_ids)

    def free(self, seq_ids: Iterable[int], abort: bool = False) -> int:
        seq_ids = list(seq_ids)
        if abort:
            self._validate(StepInput(abort_seq_ids=seq_ids))
        else:
            self._validate(StepInput(free_seq_ids=seq_ids))
        return sum(self._free(s) for s in seq_ids)

    # ---- prefix scoring -------------------------------------------------------------

    def score_prefix(self, token_ids, cache_salt: str = "", executor_ids: Iterable[str] = ()) -> list[PrefixScore]:
        wanted = list(executor_ids) or list(self.executors)
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
        for executor_id in list(executor_ids) or list(self.executors):
            kv = self._executor(executor_id)
            hit = kv.count_prefix_hashes(block_hashes) if self._namespaces[executor_id] == namespace else 0
            scores.append(PrefixScore(executor_id, hit, hit * kv.block_size, len(kv.seq_ids),
                                      kv.pool.num_free, kv.block_size))
        return scores

    # ---- accounting ---------------------------------------------------------------

    def accounting(self, executor_id: str = "") -> tuple[PoolAccounting, list[PoolAccounting]]:
        """(total, per executor); with executor_id, only that executor."""
        kvs = [self._executor(executor_id)] if executor_id else list(self.executors.values())
        parts = [executor_accounting(kv, self.seqs) for kv in kvs]
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
            raise self._missing(seq_id, "lookup")
        return seq


