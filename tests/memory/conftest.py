"""Helpers for the memory-service core tests: one small executor behind a
MemoryManager, and short ways to build steps and read plans back (whole
rows, replayed from the plans' table changes by ``plan_mirror``)."""

from __future__ import annotations

import pytest
from plan_mirror import Row, TableMirror, check_rows, domain_view  # noqa: F401 - Row: the rows tests read

from memory_service.events import EventQueue
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.policy import ThresholdModePolicy
from memory_service.records import NewSeq, StepInput, StepOutput

EID = "e0"


class Harness:
    """A MemoryManager with one registered executor and step ids counted for it."""

    def __init__(self, num_blocks: int = 8, block_size: int = 4, num_swap_blocks: int = 0,
                 max_model_len: int = 0, vocab_size: int = 0, events: bool = False,
                 swap_min_tokens: int = 256, incarnation: int = 1) -> None:
        self.events = EventQueue(enabled=events)
        self.m = MemoryManager(mode_policy=ThresholdModePolicy(swap_min_tokens=swap_min_tokens), events=self.events)
        self.spec = ExecutorSpec(EID, num_blocks=num_blocks, block_size=block_size,
                                 num_swap_blocks=num_swap_blocks, model_id="m", dtype="float32",
                                 incarnation=incarnation, pool_generation=1, max_model_len=max_model_len,
                                 vocab_size=vocab_size)
        self.m.register_executor(self.spec)
        self.bs = block_size
        self.step_id = 0
        self.mirrors: dict[str, TableMirror] = {}
        self._rows: dict[int, tuple[StepOutput, dict[str, dict[int, Row]]]] = {}  # id(out) -> (out, rows)

    # ---- views ------------------------------------------------------------------

    @property
    def kv(self):
        return self.m.executors[EID]

    @property
    def pool(self):
        return self.kv.pool

    def free_ids(self) -> list[int]:
        return self.pool.free_queue.block_ids()

    def table(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.m.seqs[seq_id].blocks]

    def ref(self, *block_ids: int) -> list[int]:
        return [self.pool.blocks[i].ref_cnt for i in block_ids]

    def seq(self, seq_id: int):
        return self.m.seqs[seq_id]

    def snapshot(self):
        """Everything a failed step must leave exactly as it was."""
        total, parts = self.m.accounting()
        seqs = {sid: (list(s.token_ids), [b.block_id for b in s.blocks], list(s.swap_blocks), s.status,
                      s.num_computed, s.num_cached_blocks, s.admitted)
                for sid, s in self.m.seqs.items()}
        pools = {eid: (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks],
                       sorted(kv.pool.cached), kv.swap.num_free)
                 for eid, kv in self.m.executors.items()}
        return (total.as_dict(), [p.as_dict() for p in parts], seqs, pools, self.m.last_step_id,
                len(self.events))

    def check(self) -> None:
        assert self.m.check_invariants() == []

    # ---- steps ------------------------------------------------------------------

    def new(self, seq_id: int, tokens, priority: int = 0, salt: str = "", max_total_tokens: int = 0,
            executor_id: str = EID) -> NewSeq:
        return NewSeq(seq_id, executor_id, list(tokens), priority=priority, cache_salt=salt,
                      max_total_tokens=max_total_tokens)

    def step_input(self, new=(), sched=(), append=None, forks=(), free=(), abort=(),
                   step_id: int | None = None) -> StepInput:
        """sched: [(seq_id, num_tokens)]; append: {seq_id: [tokens]}."""
        if step_id is None:
            step_id = self.step_id + 1
        ids, offs, toks = [], [], []
        if append:
            offs.append(0)
            for seq_id, tokens in append.items():
                ids.append(seq_id)
                toks.extend(tokens)
                offs.append(len(toks))
        return StepInput(step_id=step_id, appended_seq_ids=ids, appended_offsets=offs, appended_tokens=toks,
                         forks=[(p, list(c)) for p, c in forks], free_seq_ids=list(free),
                         abort_seq_ids=list(abort), new_seqs=list(new),
                         schedule_seq_ids=[s for s, _ in sched], schedule_num_tokens=[k for _, k in sched])

    def step(self, new=(), sched=(), append=None, forks=(), free=(), abort=(), step_id=None) -> StepOutput:
        return self.run(self.step_input(new, sched, append, forks, free, abort, step_id))

    def run(self, step: StepInput) -> StepOutput:
        out = self.m.step(step)
        self.step_id = max(self.step_id, step.step_id)
        self.check()
        self.execute(out)
        return out

    def execute(self, out: StepOutput) -> dict[str, dict[int, Row]]:
        """Replay a plan's table changes as its executors would (once per plan:
        a retried step returns the same plan) and check its slots."""
        if id(out) not in self._rows:
            by_executor = {}
            for plan in out.executor_plans:
                kv = self.m.executors[plan.executor_id]
                mirror = self.mirrors.setdefault(plan.executor_id, TableMirror(kv.block_size))
                by_executor[plan.executor_id] = mirror.apply(domain_view(plan))
            check_rows(by_executor)
            self._rows[id(out)] = (out, by_executor)
        return self._rows[id(out)][1]

    def rows(self, out: StepOutput, executor_id: str = EID) -> dict[int, Row]:
        """seq_id -> its plan row for one executor ({} when that executor has no plan)."""
        return self.execute(out).get(executor_id, {})

    @staticmethod
    def ops(out: StepOutput, executor_id: str = EID):
        plans = [p for p in out.executor_plans if p.executor_id == executor_id]
        return plans[0].ops if plans else None


@pytest.fixture
def harness():
    """Factory: harness(num_blocks=..., block_size=..., ...) -> Harness."""
    return Harness
