"""The executor's last one-token samples (executor_service.placeholders.LastSamples):
placeholders are filled with the right sequence's token whatever the row order, and a
sequence that sampled no single token is refused."""

from __future__ import annotations

import numpy as np
import pytest

from executor_service.placeholders import LastSamples
from executor_service.step import Sampling, StepInput, StepOutput
from kvpager.errors import FailedPrecondition


def _step(step_id, seq_ids, tokens, num_samples=None, prev=0):
    n = len(seq_ids)
    return StepInput(step_id=step_id, seq_ids=np.array(seq_ids, np.int64), query_lens=np.ones(n, np.int32),
                     token_ids=np.array(tokens, np.int32), prev_step_id=prev,
                     sampling=Sampling(num_samples=np.array(num_samples or [1] * n, np.int32)))


def _out(step_id, sampled):
    return StepOutput(step_id, np.array(sampled, np.int32), None, np.zeros(1, np.int32), np.zeros(0, np.int32),
                      np.zeros(0, np.float32))


def test_fill_by_sequence_whatever_the_order():
    last = LastSamples()
    last.record(_step(7, [10, 11, 12], [1, 2, 3]), _out(7, [100, 110, 120]))
    same = last.fill(_step(8, [10, 11, 12], [-1, -1, -1], prev=7))
    assert same.token_ids.tolist() == [100, 110, 120]
    other = last.fill(_step(8, [12, 5, 10], [-1, 42, -1], prev=7))
    assert other.token_ids.tolist() == [120, 42, 100]


def test_rows_with_several_samples_give_no_token():
    last = LastSamples()
    # 11 sampled two tokens (parallel sampling): there is no single one to feed it
    last.record(_step(7, [10, 11, 12], [1, 2, 3], num_samples=[1, 2, 1]), _out(7, [100, 110, 111, 120]))
    assert last.fill(_step(8, [12, 10], [-1, -1], prev=7)).token_ids.tolist() == [120, 100]
    with pytest.raises(FailedPrecondition, match="sequence 11 sampled no single token"):
        last.fill(_step(8, [10, 11], [-1, -1], prev=7))
    with pytest.raises(FailedPrecondition, match="last step is 7"):
        last.fill(_step(9, [10], [-1], prev=8))
    last.clear()
    with pytest.raises(FailedPrecondition):
        last.fill(_step(8, [10], [-1], prev=7))
