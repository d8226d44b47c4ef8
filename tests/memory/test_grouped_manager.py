"""The memory service's manager for an executor with a table per KV group
(``GroupedExecutorKV``): steps through ``MemoryManager`` with a full and a
sliding group, exactly — window frees to ⌈W / block_size⌉ + 1 blocks, plans
carrying each group's table (holes as -1), a prefix hit across groups,
fork, swap and recompute, all blocks back, invariants after every step."""

from __future__ import annotations

import pytest

from kvpager.errors import InvalidArgument
from kvpager.seq_status import SeqStatus
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MAX_KV_GROUPS, MemoryManager
from memory_service.records import NewSeq, StepInput

BS, W = 4, 8
BOUND = -(-W // BS) + 1


class Grouped:
    def __init__(self, windows=(0, W), num_blocks: int = 64, num_swap_blocks: int = 32) -> None:
        self.m = MemoryManager()
        self.m.register_executor(ExecutorSpec("e0", num_blocks, BS, num_swap_blocks, model_id="m", dtype="float32",
                                              incarnation=1, pool_generation=1, kv_group_windows=tuple(windows)))
        self.kv = self.m.executors["e0"]
        self.step_id = 0

    def step(self, new=(), sched=(), append=None, forks=(), free=()):
        self.step_id += 1
        ids, offs, toks = [], [], []
        if append:
            offs.append(0)
            for sid, t in append.items():
                ids.append(sid)
                toks.extend(t)
                offs.append(len(toks))
        out = self.m.step(StepInput(step_id=self.step_id, appended_seq_ids=ids, appended_offsets=offs,
                                    appended_tokens=toks, forks=[(p, list(c)) for p, c in forks],
                                    free_seq_ids=list(free), new_seqs=list(new),
                                    schedule_seq_ids=[s for s, _ in sched],
                                    schedule_num_tokens=[k for _, k in sched]))
        assert self.m.check_invariants() == []
        return out

    def held(self, seq_id: int) -> list[int]:
        return [sum(1 for b in t if b is not None) for t in self.m.seqs[seq_id].kv_groups.tables]

    def prefill(self, seq_id: int, tokens, chunk: int):
        out = self.step(new=[NewSeq(seq_id, "e0", list(tokens))], sched=[(seq_id, chunk)])
        while self.m.seqs[seq_id].num_computed < len(tokens):
            out = self.step(sched=[(seq_id, chunk)])
        return out

    def decode(self, seq_ids, n: int, token: int = 7) -> None:
        for _ in range(n):
            self.step(append={s: [token] for s in seq_ids}, sched=[(s, 1) for s in seq_ids])


def test_a_sequence_of_4x_the_window_holds_the_bound_in_the_sliding_group():
    g = Grouped()
    prompt = list(range(1, 4 * W + 1))
    out = g.prefill(1, prompt, chunk=W)
    (plan,) = out.executor_plans
    assert len(plan.group_tables) == 1  # group 1's changes beside group 0's
    for _ in range(12):
        g.decode([1], 1)
        seq = g.m.seqs[1]
        full, sliding = g.held(1)
        assert full == -(-seq.num_computed // BS)
        assert sliding <= BOUND
    (acct,) = g.m.accounting()[1]
    full_g, slide_g = acct.kv_groups
    assert (full_g.window, slide_g.window) == (None, W)
    assert slide_g.max_seq_blocks <= BOUND and slide_g.window_saved_blocks == full_g.logical_blocks - slide_g.logical_blocks > 0
    g.step(free=[1])
    assert g.kv.pool.num_free == g.kv.pool.num_blocks


def test_the_decode_fast_path_is_off_and_plans_start_whole_tables_with_holes():
    g = Grouped()
    assert g.m._num_grouped == 1
    prompt = list(range(1, 4 * W + 2))
    g.prefill(1, prompt, chunk=4 * W + 1)
    g.decode([1], 2)
    # The same 24-token prefix: a hit in both groups, the sliding one holding only its window.
    out = g.step(new=[NewSeq(2, "e0", prompt[:24] + [300, 301, 302])], sched=[(2, 27)])
    seq = g.m.seqs[2]
    assert seq.num_cached_tokens == 24 and seq.num_computed == 27
    (plan,) = out.executor_plans
    t0, t1 = plan.tables, plan.group_tables[0]
    i0 = list(t0.started_seq_ids).index(2)
    i1 = list(t1.started_seq_ids).index(2)
    full = list(t0.started_block_ids[t0.started_offsets[i0]:t0.started_offsets[i0 + 1]])
    slide = list(t1.started_block_ids[t1.started_offsets[i1]:t1.started_offsets[i1 + 1]])
    assert len(full) == len(slide) == 7 and -1 not in full
    first = (24 - W + 1) // BS  # what the first recomputed token's window reaches
    assert slide[:first] == [-1] * first and -1 not in slide[first:]
    g.step(free=[1, 2])
    assert g.kv.pool.num_free == g.kv.pool.num_blocks


def test_fork_swap_and_recompute_keep_every_group_sound():
    g = Grouped(windows=(W,), num_blocks=40)  # all sliding (Mistral): one group
    g.prefill(1, list(range(1, 3 * W)), chunk=W)
    g.step(append={1: [5], 2: [6]}, forks=[(1, [2])], sched=[(1, 1), (2, 1)])
    g.decode([1, 2], 3)
    kv, s2 = g.kv, g.m.seqs[2]
    kv.preempt_swap(s2)
    assert s2.status is SeqStatus.SWAPPED and not s2.blocks and len(s2.swap_blocks) == len(s2.kv_groups.swapped)
    assert g.m.check_invariants() == []
    out_ops = kv.take_ops()
    assert len(out_ops.swap_out_src) == len(s2.swap_blocks)
    assert kv.swap_in(s2, 0)
    in_ops = kv.take_ops()  # the swap blocks read are free once the step's ops are taken
    assert in_ops.swap_in_src == out_ops.swap_out_dst and not s2.swap_blocks
    assert g.m.check_invariants() == []
    kv.preempt_recompute(s2)
    assert s2.status is SeqStatus.WAITING and not s2.blocks
    got = kv.admit(s2, 100, count_hits=False)
    assert got is not None and got[0] > 0  # its own cached blocks are a hit again
    kv.commit(s2, got[1])
    assert g.m.check_invariants() == []
    kv.take_tables(), kv.take_group_tables(), kv.take_ops()  # driven outside a step: no plan to send them in
    g.step(free=[1, 2])
    assert kv.pool.num_free == kv.pool.num_blocks and kv.swap.num_free == kv.swap.num_blocks


def test_registration_refuses_too_many_groups():
    m = MemoryManager()
    with pytest.raises(InvalidArgument, match="kv_group_windows"):
        m.register_executor(ExecutorSpec("e0", 8, BS, kv_group_windows=(0,) * (MAX_KV_GROUPS + 1)))
    assert not m.executors
