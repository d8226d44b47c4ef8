"""Tokens sampled ahead within a step (``StepInput.schedule_lookahead``, a
decode burst): a running sequence's slots for its next tokens are allocated
with its last one, all or nothing; granted, they join it as placeholders
(computed, never hashed) that the next appends replace, leaving the same
blocks and prefix index as a step-by-step run."""

from __future__ import annotations

import pytest

from kvpager.errors import FailedPrecondition, InvalidArgument
from memory_service.kv_manager import ExecutorSpec
from memory_service.manager import MemoryManager
from memory_service.records import NewSeq, StepInput
from memory_service.sequence import MAX_LOOKAHEAD, MAX_PENDING, PLACEHOLDER

BS = 4


def _manager(num_blocks: int = 32, max_model_len: int = 40) -> MemoryManager:
    m = MemoryManager()
    m.register_executor(ExecutorSpec("e0", num_blocks, BS, num_swap_blocks=0, model_id="m", dtype="f32",
                                     max_model_len=max_model_len, vocab_size=100))
    return m


def _prefill(m: MemoryManager, seq_id: int, prompt: list[int], step_id: int) -> None:
    m.step(StepInput(step_id=step_id, new_seqs=[NewSeq(seq_id, "e0", prompt)], schedule_seq_ids=[seq_id],
                     schedule_num_tokens=[len(prompt)]))


def _app(pairs: dict[int, list[int]]) -> dict:
    ids = list(pairs)
    offs = [0]
    for i in ids:
        offs.append(offs[-1] + len(pairs[i]))
    return dict(appended_seq_ids=ids, appended_offsets=offs, appended_tokens=[t for i in ids for t in pairs[i]])


def _step_by_step(prompt: list[int], sampled: list[int], last_step_id: int) -> MemoryManager:
    """The reference: sequence 1 prefilled, then one token a step (no bursts), its last sample appended alone."""
    plain = _manager()
    _prefill(plain, 1, prompt, 1)
    for i, tok in enumerate(sampled[:-1]):
        plain.step(StepInput(step_id=2 + i, schedule_seq_ids=[1], schedule_num_tokens=[1], **_app({1: [tok]})))
    plain.step(StepInput(step_id=last_step_id, **_app({1: sampled[-1:]})))
    return plain


def _rows(out) -> list[tuple[int, int]]:
    return [(s, q) for p in out.executor_plans for s, q in zip(p.seq_ids, p.query_lens)]


def test_bursts_leave_what_a_step_by_step_run_leaves():
    prompt, sampled = [5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    plain = _step_by_step(prompt, sampled, 20)
    burst = _manager()
    _prefill(burst, 1, prompt, 1)
    # burst 1: the first sample is known, it computes it and samples 4 ahead (11 + 12..15 computed)
    out = burst.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[3],
                               **_app({1: [11]})))
    assert _rows(out) == [(1, 4)]
    seq = burst.seqs[1]
    assert seq.token_ids == prompt + [11, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER] and seq.num_pending == 3
    assert seq.num_computed == 7 and burst.validator.pending_total == 3
    assert seq.num_cached_blocks == 1  # block 0 (5 6 7 11) is known; block 1 holds placeholders
    # burst 2: four samples come back (three replace placeholders); it computes 15 and 3 ahead
    out = burst.step(StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[3],
                               **_app({1: [12, 13, 14, 15]})))
    assert _rows(out) == [(1, 4)]
    burst.step(StepInput(step_id=4, **_app({1: sampled[5:]})))  # 16 17 18 (placeholders) and 19
    a, b = plain.seqs[1], burst.seqs[1]
    assert b.num_pending == 0 and burst.validator.pending_total == 0
    assert (a.token_ids, a.num_computed, a.num_cached_blocks, a.block_hashes) == \
        (b.token_ids, b.num_computed, b.num_cached_blocks, b.block_hashes)
    assert sorted(plain.executors["e0"].pool.cached) == sorted(burst.executors["e0"].pool.cached)
    assert burst.check_invariants() == []


def test_a_burst_that_does_not_fit_adds_nothing():
    m = _manager(num_blocks=4)  # 16 slots
    _prefill(m, 1, [1, 2, 3, 4, 5, 6, 7], 1)  # 2 blocks
    _prefill(m, 2, [9, 8, 7, 6, 5], 2)        # 2 blocks
    # seq 2 decodes first (served: never a victim); seq 1's 8 + 8 ahead needs 2 more blocks: none to take
    out = m.step(StepInput(step_id=3, schedule_seq_ids=[2, 1], schedule_num_tokens=[1, 1],
                           schedule_lookahead=[0, 8], **_app({1: [8], 2: [10]})))
    assert _rows(out) == [(2, 1)]
    s = m.seqs[1]
    assert s.num_pending == 0 and PLACEHOLDER not in s.token_ids and m.validator.pending_total == 0
    assert m.check_invariants() == []
    # a burst that fits goes (seq 2: 6 computed, 10 + 1 ahead in its second block)
    out = m.step(StepInput(step_id=4, schedule_seq_ids=[2], schedule_num_tokens=[1], schedule_lookahead=[1],
                           **_app({2: [11]})))
    assert _rows(out) == [(2, 2)] and m.seqs[2].num_pending == 1 and m.validator.pending_total == 1
    assert m.check_invariants() == []


def test_bad_lookaheads_fail_whole_and_change_nothing():
    m = _manager()
    _prefill(m, 1, [1, 2], 1)
    m.step(StepInput(step_id=2, new_seqs=[NewSeq(2, "e0", [3, 4, 5])]))  # waiting, never scheduled
    app = _app({1: [7]})
    cases = [
        (StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[1, 1], **app),
         InvalidArgument, "differ in length"),
        (StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[-1], **app),
         InvalidArgument, "lookahead must be"),
        (StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1],
                   schedule_lookahead=[MAX_LOOKAHEAD + 1], **app), InvalidArgument, "lookahead must be"),
        (StepInput(step_id=3, schedule_seq_ids=[2], schedule_num_tokens=[3], schedule_lookahead=[2], **app),
         FailedPrecondition, "not running"),
        (StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[38], **app),
         InvalidArgument, "limit of 40"),
    ]
    for step, error, text in cases:
        before = (list(m.seqs[1].token_ids), m.seqs[1].num_pending, m.seqs[1].num_computed,
                  m.validator.pending_total)
        with pytest.raises(error, match=text):
            m.step(step)
        assert (list(m.seqs[1].token_ids), m.seqs[1].num_pending, m.seqs[1].num_computed,
                m.validator.pending_total) == before
    # a lookahead means computing every token not yet computed first
    m.step(StepInput(step_id=3, **_app({1: [7, 8]})))  # two known, not computed
    with pytest.raises(InvalidArgument, match="computes all its 2 tokens"):
        m.step(StepInput(step_id=4, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[2]))
    assert m.check_invariants() == []


def test_children_forked_in_the_step_burst_at_once():
    """n completions: the first samples fan out (a fork in the step that appends
    them), and every completion samples ahead in that same step; a plain copy
    on write of the shared tail first."""
    m = _manager()
    _prefill(m, 1, [5, 6, 7, 8, 9], 1)  # 5 tokens: a partial second block, shared by the children
    out = m.step(StepInput(step_id=2, forks=[(1, [2, 3])], schedule_seq_ids=[1, 2, 3], schedule_num_tokens=[1, 1, 1],
                           schedule_lookahead=[2, 2, 2], **_app({1: [11], 2: [12], 3: [13]})))
    assert sorted(_rows(out)) == [(1, 3), (2, 3), (3, 3)]
    for seq_id, first in ((1, 11), (2, 12), (3, 13)):
        seq = m.seqs[seq_id]
        assert seq.token_ids == [5, 6, 7, 8, 9, first, PLACEHOLDER, PLACEHOLDER] and seq.num_pending == 2
        assert seq.num_computed == 8
    assert m.validator.pending_total == 6
    assert m.executors["e0"].counters.cow_copies == 2  # two of the three tails copied, the last keeps it
    assert m.check_invariants() == []
    # a child freed in the same step cannot sample ahead
    m.step(StepInput(step_id=3, **_app({1: [21, 22, 23]})))
    with pytest.raises(FailedPrecondition, match="not running"):
        m.step(StepInput(step_id=4, forks=[(1, [4])], free_seq_ids=[4], schedule_seq_ids=[4],
                         schedule_num_tokens=[1], schedule_lookahead=[1]))
    assert m.check_invariants() == []


def _tables(out) -> list[tuple[int, int, list[int]]]:
    """(seq, first index, block ids) of every table extend in the plans."""
    found = []
    for p in out.executor_plans:
        t = p.tables
        for i, seq_id in enumerate(t.extended_seq_ids):
            found.append((seq_id, t.extended_first_index[i],
                          list(t.extended_block_ids[t.extended_offsets[i]:t.extended_offsets[i + 1]])))
    return found


def test_a_burst_cut_short_gives_back_what_it_did_not_compute():
    """An executor ran 2 of a burst's 8 sub-steps (a step was waiting behind
    it): the step that appends the 2 samples cuts it. The placeholders left
    go, its last sample is not computed, the blocks past it return (the
    executor's table cut to match), and it leaves what a step-by-step run
    leaves; it runs again in the same step."""
    prompt, sampled = [5, 6, 7], [11, 12, 13]
    plain = _step_by_step(prompt, sampled, 9)
    m = _manager()
    _prefill(m, 1, prompt, 1)
    free_before = m.executors["e0"].pool.num_free
    m.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[7],
                     **_app({1: [11]})))  # 11 and 7 placeholders computed: 11 tokens, 3 blocks
    seq = m.seqs[1]
    assert seq.num_computed == 11 and len(seq.blocks) == 3 and seq.num_pending == 7
    # 2 sub-steps ran: 12 and 13 sampled (13 not computed); the others never ran
    out = m.step(StepInput(step_id=3, cut_seq_ids=[1], **_app({1: [12, 13]})))
    assert seq.token_ids == prompt + sampled and seq.num_pending == 0 and m.validator.pending_total == 0
    assert seq.num_computed == 5 and len(seq.blocks) == 2
    assert m.executors["e0"].pool.num_free == free_before - 1 and not out.executor_plans
    a = plain.seqs[1]
    assert (a.token_ids, a.num_computed, a.num_cached_blocks, a.block_hashes) == \
        (seq.token_ids, seq.num_computed, seq.num_cached_blocks, seq.block_hashes)
    assert sorted(plain.executors["e0"].pool.cached) == sorted(m.executors["e0"].pool.cached)
    assert m.check_invariants() == []
    # 13 is computed by the next burst; cut again with its last samples, and scheduled (a burst again) in one step
    out = m.step(StepInput(step_id=4, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[3]))
    # the executor cut its own table to 2 blocks with the burst: the next plan extends it by one
    [(_, _, [block])] = _tables(out)
    assert _tables(out) == [(1, 2, [block])] and seq.block_ids[2] == block
    out = m.step(StepInput(step_id=5, cut_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1],
                           schedule_lookahead=[2], **_app({1: [14, 15]})))
    assert _rows(out) == [(1, 3)]
    assert seq.token_ids == prompt + sampled + [14, 15, PLACEHOLDER, PLACEHOLDER] and seq.num_computed == 10
    assert m.check_invariants() == []


def test_a_cut_with_its_next_sub_step_carried_keeps_that_token_computed():
    """2 of 8 sub-steps ran and the third was carried into the step that cut
    the burst (its sample still in flight): every known token stays computed
    (13 included), the blocks past them return, and a step planned now feeds
    the carried sample (pending) and computes it; appended later, it leaves
    what a step-by-step run leaves."""
    prompt, sampled = [5, 6, 7], [11, 12, 13, 14]
    plain = _step_by_step(prompt, sampled, 9)
    m = _manager()
    _prefill(m, 1, prompt, 1)
    m.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[7],
                     **_app({1: [11]})))
    seq = m.seqs[1]
    out = m.step(StepInput(step_id=3, carried_seq_ids=[1], pending_seq_ids=[1], schedule_seq_ids=[1],
                           schedule_num_tokens=[1], **_app({1: [12, 13]})))
    assert seq.token_ids == prompt + [11, 12, 13, PLACEHOLDER] and seq.num_pending == 1
    assert seq.num_computed == 7 and len(seq.blocks) == 2 and _rows(out) == [(1, 1)]
    assert m.check_invariants() == []
    m.step(StepInput(step_id=4, **_app({1: [14]})))
    a = plain.seqs[1]  # which has not computed 14 yet: the step planned behind the cut did
    assert (a.token_ids, a.num_computed + 1, a.num_cached_blocks, a.block_hashes) == \
        (seq.token_ids, seq.num_computed, seq.num_cached_blocks, seq.block_hashes)
    assert m.check_invariants() == []


def test_a_carried_sub_step_that_was_the_bursts_last_gives_back_nothing():
    """A burst of 3 cut after 2 sub-steps with the third carried: it computed
    everything it was granted, so nothing goes back, and nothing is pending
    unless a step feeds the carried sample."""
    m = _manager()
    _prefill(m, 1, [5, 6, 7], 1)
    m.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[2],
                     **_app({1: [11]})))
    seq = m.seqs[1]
    blocks = list(seq.block_ids)
    m.step(StepInput(step_id=3, carried_seq_ids=[1], **_app({1: [12, 13]})))
    assert seq.token_ids == [5, 6, 7, 11, 12, 13] and seq.num_pending == 0 and seq.num_computed == 6
    assert list(seq.block_ids) == blocks and m.check_invariants() == []


def test_bad_cuts_fail_whole_and_change_nothing():
    m = _manager()
    _prefill(m, 1, [1, 2, 3, 4, 5, 6, 7], 1)
    m.step(StepInput(step_id=2, new_seqs=[NewSeq(2, "e0", [3, 4, 5])]))  # waiting, never scheduled
    m.step(StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[3],
                     **_app({1: [8]})))
    cases = [
        (StepInput(step_id=4, cut_seq_ids=[9], **_app({1: [9]})), Exception, "unknown sequence 9"),
        (StepInput(step_id=4, cut_seq_ids=[2], **_app({1: [9]})), FailedPrecondition, "not a running"),
        (StepInput(step_id=4, cut_seq_ids=[1, 1], **_app({1: [9]})), InvalidArgument, "twice"),
        (StepInput(step_id=4, cut_seq_ids=[1], free_seq_ids=[1], **_app({1: [9]})), Exception, "sequence 1"),
        # all four samples back: nothing was cut
        (StepInput(step_id=4, cut_seq_ids=[1], **_app({1: [9, 10, 11, 12]})), FailedPrecondition, "nothing past"),
        # no sample back: token 8 would lose its slot in block 1 (5 6 7 8), which the prefix index holds
        (StepInput(step_id=4, cut_seq_ids=[1], **_app({})), FailedPrecondition, "prompt or of blocks"),
        # carried: as cuts, and never in both lists, never with more computed than the burst was granted
        (StepInput(step_id=4, cut_seq_ids=[1], carried_seq_ids=[1], **_app({1: [9]})), InvalidArgument, "twice"),
        (StepInput(step_id=4, carried_seq_ids=[1, 1], **_app({1: [9]})), InvalidArgument, "twice"),
        (StepInput(step_id=4, carried_seq_ids=[2], **_app({1: [9]})), FailedPrecondition, "carried: .* not a running"),
        (StepInput(step_id=4, carried_seq_ids=[1], **_app({1: [9, 10, 11, 12]})), FailedPrecondition,
         "nothing past"),
        # a plain cut's sample is known: nothing of it can be pending
        (StepInput(step_id=4, cut_seq_ids=[1], pending_seq_ids=[1], **_app({1: [9]})), FailedPrecondition,
         "not a running"),
        # carried, but scheduled without its pending sample: nothing left to compute
        (StepInput(step_id=4, carried_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1], **_app({1: [9]})),
         InvalidArgument, "no token left"),
    ]
    for step, error, text in cases:
        seq = m.seqs[1]
        before = (list(seq.token_ids), seq.num_pending, seq.num_computed, len(seq.blocks), m.validator.pending_total)
        with pytest.raises(error, match=text):
            m.step(step)
        assert (list(seq.token_ids), seq.num_pending, seq.num_computed, len(seq.blocks),
                m.validator.pending_total) == before
    assert m.check_invariants() == []


def test_a_burst_never_takes_its_tenant_over_its_quota():
    """A tenant may hold 4 of 8 blocks: a decode that would sample 10 ahead
    needs 5, so it computes its token alone (no placeholder, nobody
    preempted); within the quota the burst goes."""
    from memory_service.policy import TenantQuota

    m = MemoryManager(quota=TenantQuota(0.5))
    m.register_executor(ExecutorSpec("e0", 8, BS, num_swap_blocks=0, model_id="m", dtype="f32",
                                     max_model_len=40, vocab_size=100))
    m.step(StepInput(step_id=1, new_seqs=[NewSeq(1, "e0", [1, 2, 3, 4, 5, 6, 7], tenant="a")],
                     schedule_seq_ids=[1], schedule_num_tokens=[7]))  # 2 blocks
    out = m.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[10],
                           **_app({1: [8]})))
    seq = m.seqs[1]
    assert _rows(out) == [(1, 1)] and not out.preempted and not out.unscheduled
    assert seq.num_pending == 0 and m.validator.pending_total == 0 and len(seq.blocks) == 2
    out = m.step(StepInput(step_id=3, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[7],
                           **_app({1: [9]})))  # 9 + 7 ahead: 16 tokens, 4 blocks
    assert _rows(out) == [(1, 8)] and seq.num_pending == 7 and len(seq.blocks) == 4
    assert m.check_invariants() == []


def test_a_burst_planned_ahead_feeds_the_last_sample_of_the_one_in_flight():
    """The gateway plans a burst's next one near its end: nothing of the first
    is back, its last sample is fed (pending) and the second samples ahead too.
    The memory service ends as a step-by-step run would."""
    prompt, sampled = [5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19]
    plain = _step_by_step(prompt, sampled, 20)
    m = _manager()
    _prefill(m, 1, prompt, 1)
    m.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[3],
                     **_app({1: [11]})))  # burst 1: computes 11 and 12..14 (placeholders), samples 12..15
    out = m.step(StepInput(step_id=3, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1],
                           schedule_lookahead=[3]))  # burst 2, fed 15 (pending): computes 15..18, samples 16..19
    assert _rows(out) == [(1, 4)]
    seq = m.seqs[1]
    assert seq.token_ids == prompt + [11] + [PLACEHOLDER] * 7 and seq.num_pending == 7 and seq.num_computed == 11
    m.step(StepInput(step_id=4, **_app({1: [12, 13, 14, 15]})))  # burst 1 back: its placeholders and the fed one
    assert seq.num_pending == 3 and m.validator.pending_total == 3
    m.step(StepInput(step_id=20, **_app({1: sampled[5:]})))
    a = plain.seqs[1]
    assert seq.num_pending == 0 and m.validator.pending_total == 0
    assert (a.token_ids, a.num_computed, a.num_cached_blocks, a.block_hashes) == \
        (seq.token_ids, seq.num_computed, seq.num_cached_blocks, seq.block_hashes)
    assert m.check_invariants() == []


def test_a_sequence_holds_at_most_max_pending_plus_max_lookahead_unknown_tokens():
    bound = MAX_PENDING + MAX_LOOKAHEAD
    m = _manager(num_blocks=64, max_model_len=200)
    _prefill(m, 1, [5, 6, 7], 1)
    m.step(StepInput(step_id=2, schedule_seq_ids=[1], schedule_num_tokens=[1], schedule_lookahead=[MAX_LOOKAHEAD],
                     **_app({1: [11]})))
    for step_id in range(3, 3 + bound - MAX_LOOKAHEAD):
        m.step(StepInput(step_id=step_id, pending_seq_ids=[1], schedule_seq_ids=[1], schedule_num_tokens=[1]))
    assert m.seqs[1].num_pending == bound
    before = (list(m.seqs[1].token_ids), m.validator.pending_total)
    with pytest.raises(FailedPrecondition, match=f"more than {bound}"):
        m.step(StepInput(step_id=90, pending_seq_ids=[1]))
    assert (list(m.seqs[1].token_ids), m.validator.pending_total) == before
    assert m.check_invariants() == []
