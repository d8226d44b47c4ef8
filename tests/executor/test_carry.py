"""executor_service.carry: the sampling and tables of a step that cut a
burst, with the burst's carried rows after its own."""

from __future__ import annotations

import numpy as np

from executor_service.carry import Carry, answer, concat_sampling, merge
from executor_service.step import Sampling, StepInput, StepOutput
from executor_service.tables import Resolved, TableChanges


def _sampling(n: int, **kw) -> Sampling:
    base = dict(num_samples=np.ones(n, np.int32), temperature=np.zeros(n, np.float32),
                top_p=np.ones(n, np.float32), top_k=np.zeros(n, np.int32), seeds=np.arange(n, dtype=np.int64),
                num_top_logprobs=np.zeros(n, np.int32))
    base.update(kw)
    return Sampling(**base)


def test_columns_one_side_lacks_take_their_defaults_and_offsets_run_on():
    a = _sampling(2, num_samples=np.array([0, 2], np.int32), seeds=np.array([5, 6], np.int64),
                  num_top_logprobs=np.array([0, 3], np.int32), presence_penalty=np.array([0.5, 0], np.float32),
                  prompt_lens=np.array([4, 7], np.int32), bias_offsets=np.array([0, 1, 1], np.int32),
                  bias_token_ids=np.array([9], np.int32), bias_values=np.array([-np.inf], np.float32),
                  history_offsets=np.array([0, 2, 3], np.int32), history_token_ids=np.array([1, 2, 3], np.int32))
    b = _sampling(3, temperature=np.full(3, 0.7, np.float32), return_logprobs=True,
                  min_p=np.array([0.1, 0, 0.2], np.float32), repetition_penalty=np.array([1, 1.2, 1], np.float32))
    s = concat_sampling(a, 2, b, 3)
    assert s.num_samples.tolist() == [0, 2, 1, 1, 1] and s.seeds.tolist() == [5, 6, 0, 1, 2]
    assert s.temperature.tolist() == [0, 0, *([np.float32(0.7)] * 3)] and s.return_logprobs
    assert s.num_top_logprobs.tolist() == [0, 3, 0, 0, 0]
    assert s.presence_penalty.tolist() == [0.5, 0, 0, 0, 0] and s.frequency_penalty is None
    assert s.repetition_penalty.tolist() == [1, 1, 1, np.float32(1.2), 1]
    assert s.min_p.tolist() == [0, 0, np.float32(0.1), 0, np.float32(0.2)]
    assert s.prompt_lens.tolist() == [4, 7, 0, 0, 0]
    assert s.bias_offsets.tolist() == [0, 1, 1, 1, 1, 1] and s.bias_token_ids.tolist() == [9]
    assert s.history_offsets.tolist() == [0, 2, 3, 3, 3, 3] and s.history(1).tolist() == [3]
    assert s.history(3) is None and s.penalized(5).tolist() == [True, False, False, True, False]
    plain = concat_sampling(_sampling(1), 1, _sampling(1), 1)
    assert plain.bias_offsets is None and plain.history_offsets is None and plain.min_p is None


def test_merge_puts_the_carried_rows_after_the_steps_own():
    step = StepInput(step_id=7, seq_ids=np.array([3], np.int64), query_lens=np.array([4], np.int32),
                     token_ids=np.array([11, 12, 13, 14], np.int32), sampling=_sampling(1), prev_step_id=6)
    resolved = Resolved(reset=False, epoch=1, staged={3: None}, row_ids=np.array([-1]), context_lens=np.array([0]),
                        tables=np.array([[5]], np.int32), slot_mapping=np.array([20, 21, 22, 23], np.int32))
    carried = StepInput(step_id=6, seq_ids=np.array([1, 2], np.int64), query_lens=np.ones(2, np.int32),
                        token_ids=np.array([40, 41], np.int32), sampling=_sampling(2, temperature=np.ones(2)))
    view = Resolved(reset=False, epoch=1, staged={}, row_ids=np.array([0, 1]), context_lens=np.array([9, 6]),
                    tables=np.array([[1, 2, 3], [4, 6, 0]], np.int32), slot_mapping=np.array([9, 26], np.int32))
    merged, tables, kept = merge(step, resolved, Carry(6, carried, view))
    assert kept.tolist() == [True, True]
    assert merged.step_id == 7 and merged.seq_ids.tolist() == [3, 1, 2]
    assert merged.query_lens.tolist() == [4, 1, 1] and merged.token_ids.tolist() == [11, 12, 13, 14, 40, 41]
    assert merged.sampling.temperature.tolist() == [0, 1, 1] and merged.sampling.seeds.tolist() == [0, 0, 1]
    assert tables.tables.tolist() == [[5, 0, 0], [1, 2, 3], [4, 6, 0]]
    assert tables.context_lens.tolist() == [0, 9, 6] and tables.row_ids.tolist() == [-1, 0, 1]
    assert tables.slot_mapping.tolist() == [20, 21, 22, 23, 9, 26] and tables.staged == {3: None}


def test_a_carried_row_whose_sequence_the_step_drops_is_left_out_and_answered_with_a_placeholder():
    """Sequence 1 ended while the burst ran: the step that cut it drops it, and
    its slot may be one this step's own rows write, so it is not computed."""
    step = StepInput(step_id=7, seq_ids=np.array([3], np.int64), query_lens=np.array([2], np.int32),
                     token_ids=np.array([11, 12], np.int32), sampling=_sampling(1), prev_step_id=6,
                     tables=TableChanges(dropped=np.array([1], np.int64)))
    resolved = Resolved(reset=False, epoch=1, staged={}, row_ids=np.array([-1]), context_lens=np.array([0]),
                        tables=np.array([[9]], np.int32), slot_mapping=np.array([72, 73], np.int32))
    carried = StepInput(step_id=6, seq_ids=np.array([1, 2], np.int64), query_lens=np.ones(2, np.int32),
                        token_ids=np.array([40, 41], np.int32), sampling=_sampling(2, seeds=np.array([8, 9])))
    view = Resolved(reset=False, epoch=1, staged={}, row_ids=np.array([0, 1]), context_lens=np.array([9, 6]),
                    tables=np.array([[1, 9], [4, 6]], np.int32), slot_mapping=np.array([73, 54], np.int32))
    merged, tables, kept = merge(step, resolved, Carry(6, carried, view))
    assert kept.tolist() == [False, True] and merged.seq_ids.tolist() == [3, 2]
    assert merged.sampling.seeds.tolist() == [0, 9] and tables.slot_mapping.tolist() == [72, 73, 54]
    out = StepOutput(step_id=7, sampled_token_ids=np.array([100, 200], np.int32),
                     sampled_logprobs=np.array([-1.0, -2.0], np.float32), top_offsets=np.zeros(3, np.int32),
                     top_token_ids=np.zeros(0, np.int32), top_logprobs=np.zeros(0, np.float32))
    whole = answer(out, kept)
    assert whole.sampled_token_ids.tolist() == [100, -1, 200]
    assert whole.sampled_logprobs.tolist() == [-1.0, 0.0, -2.0] and whole.top_offsets.tolist() == [0, 0, 0, 0]
