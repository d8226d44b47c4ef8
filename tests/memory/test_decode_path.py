"""The decode fast path (StepValidator.check_decode, Planner._schedule_decode)
against the general path: two managers get the same steps, one with the fast
path switched off; every plan, outcome, error and piece of state must agree.

The runs are decode-heavy on tiny pools of two executors, with forks (so
tails are shared and copied), prefills and frees in between, so the fast path
meets block boundaries, copy-on-write, pool shortage (the hand-over to the
general loop and its preemptions) and interleaved executors."""

from __future__ import annotations

import random

import pytest

from kvpager.errors import KvpagerError
from kvpager.seq_status import SeqStatus
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.policy import ThresholdModePolicy
from memory_service.records import NewSeq, StepInput

VOCAB = 50
SPECS = (("e0", 24, 4, 8), ("e1", 16, 2, 0))  # executor, blocks, block size, swap blocks


def _manager() -> MemoryManager:
    m = MemoryManager(mode_policy=ThresholdModePolicy(swap_min_tokens=6))
    for eid, blocks, bs, swap in SPECS:
        m.register_executor(ExecutorSpec(eid, blocks, bs, num_swap_blocks=swap, model_id="m", dtype="f32",
                                         max_model_len=40, vocab_size=VOCAB))
    return m


def _state(m: MemoryManager):
    seqs = {sid: (list(s.token_ids), list(s.block_ids), [b.block_id for b in s.blocks], list(s.swap_blocks),
                  s.status, s.num_computed, s.num_cached_blocks, list(s.block_hashes), s.admitted)
            for sid, s in m.seqs.items()}
    pools = {eid: (kv.pool.free_queue.block_ids(), [b.ref_cnt for b in kv.pool.blocks],
                   {h: b.block_id for h, b in kv.pool.cached.items()}, kv.swap.num_free, kv.counters)
             for eid, kv in m.executors.items()}
    total, parts = m.accounting()
    return seqs, pools, total.as_dict(), [p.as_dict() for p in parts], m.last_step_id


def _plans(out):
    return ([(p.executor_id, p.incarnation, list(p.seq_ids), list(p.query_lens), p.tables, p.ops)
             for p in out.executor_plans],
            out.preempted, out.unscheduled, [(r.seq_id, r.reason) for r in out.rejected])


class Pair:
    def __init__(self) -> None:
        self.fast, self.general = _manager(), _manager()
        self.general.validator.check_decode = lambda step: None
        self.taken = {"fast": 0, "general": 0}
        check = self.fast.validator.check_decode

        def spy(step):
            found = check(step)
            self.taken["fast" if found is not None else "general"] += 1
            return found

        self.fast.validator.check_decode = spy

    def run(self, step: StepInput):
        results = []
        for m in (self.fast, self.general):
            try:
                results.append(("ok", _plans(m.step(step))))
            except KvpagerError as exc:
                results.append((type(exc).__name__, str(exc)))
        assert results[0] == results[1]
        assert _state(self.fast) == _state(self.general)
        assert self.fast.check_invariants() == []
        return results[0][0]


def _general_step(rnd: random.Random, m: MemoryManager, step_id: int, next_id: list[int]) -> StepInput:
    """New prompts, a fork, frees; every waiting or swapped sequence asks back in."""
    step = StepInput(step_id=step_id)
    live = sorted(m.seqs)
    if len(live) > 10:
        step.free_seq_ids = rnd.sample(live, len(live) - 8)
    rest = [s for s in live if s not in step.free_seq_ids]
    forkable = [s for s in rest if m.seqs[s].status is not SeqStatus.SWAPPED]
    if forkable and rnd.random() < 0.5:
        next_id[0] += 1
        step.forks = [(rnd.choice(forkable), [next_id[0]])]
    for _ in range(rnd.randint(0, 3)):
        next_id[0] += 1
        prompt = [rnd.randrange(VOCAB) for _ in range(rnd.randint(1, 14))]
        step.new_seqs.append(NewSeq(next_id[0], rnd.choice(("e0", "e1")), prompt, priority=rnd.randint(0, 2)))
        step.schedule_seq_ids.append(next_id[0])
        step.schedule_num_tokens.append(100)
    appended = []
    for s in rest:
        seq = m.seqs[s]
        if seq.status is SeqStatus.RUNNING:
            continue
        if seq.status is SeqStatus.SWAPPED and len(seq.token_ids) == seq.num_computed:
            if len(seq.token_ids) == seq.token_limit:
                continue  # finished: nothing to compute
            appended.append(s)  # its sampled token first
        step.schedule_seq_ids.append(s)
        step.schedule_num_tokens.append(100)
    step.appended_seq_ids, step.appended_tokens = appended, [rnd.randrange(VOCAB) for _ in appended]
    step.appended_offsets = list(range(len(appended) + 1)) if appended else []
    return step


def _decode_step(rnd: random.Random, m: MemoryManager, step_id: int) -> StepInput:
    """One token appended to, and one scheduled for, running sequences in a random order
    (a computed-up one gets a token first; a mid-prefill one computes its next)."""
    running = [s for s, q in m.seqs.items() if q.status is SeqStatus.RUNNING and len(q.token_ids) < q.token_limit]
    chosen = rnd.sample(running, rnd.randint(1, len(running))) if running else []
    appended = [s for s in chosen if len(m.seqs[s].token_ids) == m.seqs[s].num_computed]
    others = [s for s in m.seqs if s not in chosen and len(m.seqs[s].token_ids) < m.seqs[s].token_limit]
    if others and rnd.random() < 0.2:
        appended.append(rnd.choice(others))  # a token for a sequence not scheduled now
    if rnd.random() < 0.5:
        appended = [s for s in chosen if s in appended] + [s for s in appended if s not in chosen]
        if [s for s in chosen if s in appended] == chosen:
            chosen = [s for s in appended if s in chosen]  # the same order as the appends: one look-up
    return StepInput(step_id=step_id, appended_seq_ids=appended, appended_offsets=list(range(len(appended) + 1)),
                     appended_tokens=[rnd.randrange(VOCAB) for _ in appended], schedule_seq_ids=chosen,
                     schedule_num_tokens=[1] * len(chosen))


@pytest.mark.parametrize("seed", range(12))
def test_fast_path_is_the_general_path(seed):
    rnd = random.Random(seed)
    pair = Pair()
    next_id = [0]
    for step_id in range(1, 220):
        m = pair.fast
        decode = m.seqs and rnd.random() < 0.75
        step = _decode_step(rnd, m, step_id) if decode else _general_step(rnd, m, step_id, next_id)
        assert pair.run(step) == "ok"
    assert pair.taken["fast"] > 60


def test_the_runs_meet_what_the_fast_path_hands_over():
    """Across the seeds the decode steps cross blocks, copy shared tails and preempt."""
    copies = preempted = crossed = 0
    for seed in range(12):
        rnd = random.Random(seed)
        pair = Pair()
        next_id = [0]
        for step_id in range(1, 220):
            m = pair.fast
            if m.seqs and rnd.random() < 0.75:
                step = _decode_step(rnd, m, step_id)
                out = m.step(step)
                copies += sum(len(p.ops.copy_src) for p in out.executor_plans)
                preempted += len(out.preempted)
                crossed += sum(len(p.tables.extended_seq_ids) for p in out.executor_plans)
            else:
                m.step(_general_step(rnd, m, step_id, next_id))
    assert copies and preempted and crossed


def _decoding_pair(n: int = 6) -> Pair:
    pair = Pair()
    new = [NewSeq(i, "e0" if i % 2 else "e1", [i % VOCAB] * (3 + i), max_total_tokens=8 + i) for i in range(n)]
    step = StepInput(step_id=1, new_seqs=new, schedule_seq_ids=list(range(n)), schedule_num_tokens=[100] * n)
    assert pair.run(step) == "ok"
    return pair


def _decode(ids, step_id, tokens=None, offsets=None, nums=None, sched=None) -> StepInput:
    tokens = [1] * len(ids) if tokens is None else tokens
    return StepInput(step_id=step_id, appended_seq_ids=list(ids),
                     appended_offsets=list(range(len(ids) + 1)) if offsets is None else offsets,
                     appended_tokens=tokens, schedule_seq_ids=list(ids if sched is None else sched),
                     schedule_num_tokens=[1] * len(ids if sched is None else sched) if nums is None else nums)


@pytest.mark.parametrize("case", ["unknown", "duplicate", "vocab", "negative", "offsets", "over_limit", "zero",
                                  "done", "counts"])
def test_bad_decode_steps_fail_as_the_general_check_says(case):
    pair = _decoding_pair()
    ids = list(range(6))
    steps = {"unknown": _decode([*ids, 99], 2),
             "duplicate": _decode([*ids, 0], 2),
             "vocab": _decode(ids, 2, tokens=[1, 2, 3, VOCAB, 4, 5]),
             "negative": _decode(ids, 2, tokens=[1, 2, -3, 0, 4, 5]),
             "offsets": _decode(ids, 2, offsets=[0, 0, 2, 3, 4, 5, 6]),
             "zero": _decode(ids, 2, nums=[1, 1, 0, 1, 1, 1]),
             "done": _decode(ids[1:], 2, sched=ids),       # sequence 0 has nothing left to compute
             "counts": _decode(ids, 2, nums=[1] * 5)}
    if case == "over_limit":
        for step_id in range(2, 40):  # decode until sequence 0 (max 8 tokens) is full
            if len(pair.fast.seqs[0].token_ids) == pair.fast.seqs[0].token_limit:
                break
            live = [s for s in ids if len(pair.fast.seqs[s].token_ids) < pair.fast.seqs[s].token_limit]
            assert pair.run(_decode(live, step_id)) == "ok"
        step = _decode(ids, step_id)
    else:
        step = steps[case]
    assert pair.taken["fast"] or case != "over_limit"
    before = pair.taken["fast"]
    assert pair.run(step) != "ok"
    assert pair.taken["fast"] == before  # the fast path declined it; the general check named the error


def test_a_plain_decode_takes_the_fast_path_and_plans_unit_rows():
    pair = _decoding_pair()
    ids = [5, 3, 1, 0, 2, 4]  # interleaved executors
    assert pair.run(_decode(ids, 2)) == "ok"
    assert pair.taken["fast"] == 1
    out = pair.fast._last_output
    rows = {p.executor_id: list(p.seq_ids) for p in out.executor_plans}
    assert rows == {"e0": [5, 3, 1], "e1": [0, 2, 4]}
    assert all(list(p.query_lens) == [1, 1, 1] for p in out.executor_plans)
