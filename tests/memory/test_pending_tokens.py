"""Placeholders for tokens still being sampled (``StepInput.pending_seq_ids``):
the gateway plans a step while the previous one runs, so a decode is
scheduled before its token id is known. A placeholder counts as a token
(room, scheduling) but is never hashed; the next append replaces it, and
the block it completes enters the prefix index then, with the same hash a
step-by-step run gives."""

from __future__ import annotations

import pytest

from kvpager.errors import FailedPrecondition, InvalidArgument
from kvpager.seq_status import SeqStatus
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.records import NewSeq, StepInput
from memory_service.sequence import MAX_PENDING, PLACEHOLDER

BS = 4


def _manager() -> MemoryManager:
    m = MemoryManager()
    m.register_executor(ExecutorSpec("e0", 32, BS, num_swap_blocks=0, model_id="m", dtype="f32",
                                     max_model_len=24, vocab_size=100))
    return m


def _app(pairs: dict[int, int]) -> dict:
    ids = list(pairs)
    return dict(appended_seq_ids=ids, appended_offsets=list(range(len(ids) + 1)),
                appended_tokens=[pairs[i] for i in ids])


def _prefill(m: MemoryManager, seq_id: int, prompt: list[int], step_id: int) -> None:
    m.step(StepInput(step_id=step_id, new_seqs=[NewSeq(seq_id, "e0", prompt)], schedule_seq_ids=[seq_id],
                     schedule_num_tokens=[len(prompt)]))


def _rows(out) -> list[tuple[int, int]]:
    return [(s, q) for p in out.executor_plans for s, q in zip(p.seq_ids, p.query_lens)]


def test_pipelined_run_indexes_the_same_blocks_as_a_step_by_step_run():
    prompt, sampled = [5, 6, 7], [11, 12, 13, 14, 15, 16]
    # step by step: append what the last step sampled, then schedule it
    plain = _manager()
    _prefill(plain, 1, prompt, 1)
    for i, tok in enumerate(sampled[:-1]):
        plain.step(StepInput(step_id=2 + i, schedule_seq_ids=[1], schedule_num_tokens=[1], **_app({1: tok})))
    # pipelined: each step is planned while the previous one samples; its token arrives a step late
    piped = _manager()
    _prefill(piped, 1, prompt, 1)
    out = piped.step(StepInput(step_id=2, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1]))
    assert _rows(out) == [(1, 1)]
    seq = piped.seqs[1]
    assert seq.token_ids == prompt + [PLACEHOLDER] and seq.num_pending == 1
    # the placeholder completed block 0, but it is not indexed before its id is known
    assert seq.num_computed == 4 and seq.num_cached_blocks == 0 and seq.block_hashes == []
    for i, tok in enumerate(sampled[:-2]):
        piped.step(StepInput(step_id=3 + i, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1],
                             **_app({1: tok})))
        assert seq.num_pending == 1 and seq.token_ids[-1] == PLACEHOLDER
    # drain: the last placeholder's token arrives; nothing is pending any more
    piped.step(StepInput(step_id=9, **_app({1: sampled[-2]})))
    a, b = plain.seqs[1], piped.seqs[1]
    assert b.num_pending == 0 and PLACEHOLDER not in b.token_ids
    assert (a.token_ids, a.num_computed, a.num_cached_blocks, a.block_hashes) == \
        (b.token_ids, b.num_computed, b.num_cached_blocks, b.block_hashes)
    assert sorted(plain.executors["e0"].pool.cached) == sorted(piped.executors["e0"].pool.cached)
    assert piped.check_invariants() == []
    assert piped.validator.pending_total == 0


def test_a_pending_step_goes_the_general_way_and_the_fast_path_returns_after():
    m = _manager()
    _prefill(m, 1, [1, 2], 1)
    seen = []
    check = m.validator.check_decode
    m.validator.check_decode = lambda step: seen.append(check(step) is not None) or check(step)
    m.step(StepInput(step_id=2, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1]))
    # back to step by step: 9 replaces the placeholder, 8 (sampled by step 2) is new: still the general path
    m.step(StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], appended_seq_ids=[1],
                     appended_offsets=[0, 2], appended_tokens=[9, 8]))
    m.step(StepInput(step_id=4, schedule_seq_ids=[1], schedule_num_tokens=[1], **_app({1: 7})))
    assert seen == [False, False, True]
    assert m.seqs[1].token_ids == [1, 2, 9, 8, 7]


def test_freeing_a_sequence_with_a_placeholder_forgets_it():
    m = _manager()
    _prefill(m, 1, [1, 2], 1)
    m.step(StepInput(step_id=2, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1]))
    assert m.validator.pending_total == 1
    m.step(StepInput(step_id=3, free_seq_ids=[1]))  # it stopped on the token being sampled
    assert m.validator.pending_total == 0 and m.check_invariants() == []
    total, _ = m.accounting()
    assert total.used_blocks == 0


def test_bad_pending_steps_fail_whole_and_change_nothing():
    m = _manager()
    _prefill(m, 1, [1, 2], 1)
    m.step(StepInput(step_id=2, new_seqs=[NewSeq(2, "e0", [3, 4, 5])]))  # waiting, never scheduled
    cases = [
        (StepInput(step_id=3, pending_seq_ids=[1, 1]), InvalidArgument, "twice"),
        (StepInput(step_id=3, pending_seq_ids=[7]), Exception, "7"),
        (StepInput(step_id=3, pending_seq_ids=[2]), FailedPrecondition, "not running"),
        (StepInput(step_id=3, new_seqs=[NewSeq(3, "e0", [1])], pending_seq_ids=[3]), FailedPrecondition, "new"),
        (StepInput(step_id=3, free_seq_ids=[1], pending_seq_ids=[1]), Exception, "1"),
    ]
    for step, error, text in cases:
        before = (list(m.seqs[1].token_ids), m.seqs[1].num_pending, m.validator.pending_total)
        with pytest.raises(error, match=text):
            m.step(step)
        assert (list(m.seqs[1].token_ids), m.seqs[1].num_pending, m.validator.pending_total) == before
    # no fork of a sequence whose token is being sampled (the bound on unknown tokens: test_lookahead.py)
    for i in range(MAX_PENDING):
        m.step(StepInput(step_id=4 + i, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1]))
    with pytest.raises(FailedPrecondition, match="still being sampled"):
        m.step(StepInput(step_id=9, forks=[(1, [5])]))
    # scheduling past the placeholders is computing what is not there
    with pytest.raises(InvalidArgument, match="no token left"):
        m.step(StepInput(step_id=9, schedule_seq_ids=[1], schedule_num_tokens=[1]))
    assert m.check_invariants() == []


def test_pending_counts_against_the_token_limit():
    m = _manager()  # max_model_len 24
    _prefill(m, 1, list(range(1, 24)), 1)  # 23 tokens: one more fits
    m.step(StepInput(step_id=2, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1]))
    with pytest.raises(InvalidArgument, match="limit"):
        m.step(StepInput(step_id=3, pending_seq_ids=[1], **_app({1: 50})))
    assert m.seqs[1].status is SeqStatus.RUNNING
