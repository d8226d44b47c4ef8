"""Input tokens the executor fills in itself: what it sampled last step.

A gateway that plans a step while the previous one runs does not know the
token each decode feeds in yet: it sends ``PLACEHOLDER`` for it and names
the step whose sample it is (``StepInput.prev_step_id``, this executor's
previous Execute). The executor keeps the one-token samples of its last step
and substitutes them before anything else looks at the step, so tables,
penalty histories and the forward only ever see real token ids. Which step
the placeholders refer to is checked: a plan out of step with the executor
is refused (FAILED_PRECONDITION), never run on stale tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from executor_service.step import StepInput, StepOutput
from kvpager.errors import FailedPrecondition, InvalidArgument

PLACEHOLDER = -1


def check_placeholders(step: StepInput) -> None:
    """A placeholder is a row's only token (a decode) and needs prev_step_id."""
    holes = step.token_ids == PLACEHOLDER
    if not holes.any():
        return
    if not step.prev_step_id:
        raise InvalidArgument("token_ids: a placeholder (-1) needs prev_step_id, the step that samples it")
    starts = np.zeros(len(step.query_lens) + 1, np.int64)
    np.cumsum(step.query_lens, out=starts[1:])
    rows = np.nonzero(step.query_lens == 1)[0]
    allowed = np.zeros(len(step.token_ids), bool)
    allowed[starts[rows]] = True
    if (holes & ~allowed).any():
        raise InvalidArgument("token_ids: a placeholder (-1) may only be a decode row's single token")


class LastSamples:
    """The previous step's one-token samples, per sequence (columnar: no per-row work)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.step_id = 0
        self._seq_ids = np.zeros(0, np.int64)   # [k]: the rows that sampled one token
        self._tokens = np.zeros(0, np.int32)    # [k]: the token each sampled

    def record(self, step: StepInput, out: StepOutput) -> None:
        num = step.sampling.num_samples
        self.step_id = step.step_id
        if step.decode_steps > 1:  # a burst: each row's last sample (executor_service.burst)
            from executor_service.burst import last_samples

            self._seq_ids, self._tokens = step.seq_ids, last_samples(step, out)
            return
        if len(num) == len(out.sampled_token_ids) and (num == 1).all():  # a decode: one token per row
            self._seq_ids, self._tokens = step.seq_ids, out.sampled_token_ids
            return
        # sampled_token_ids holds sum(num_samples) tokens in row order: a one-token row's is at its offset.
        offsets = np.zeros(len(num) + 1, np.int64)
        np.cumsum(num, out=offsets[1:])
        rows = np.nonzero(num == 1)[0]
        self._seq_ids, self._tokens = step.seq_ids[rows], out.sampled_token_ids[offsets[rows]]

    def fill(self, step: StepInput) -> StepInput:
        """The step with its placeholders replaced (checked: ``check_placeholders``)."""
        holes = np.nonzero(step.token_ids == PLACEHOLDER)[0]
        if step.decode_steps > 1 and len(holes):  # a burst fills only first tokens here; it samples the rest
            from executor_service.burst import row_starts

            starts = row_starts(step.query_lens)[:-1]
            holes = starts[step.token_ids[starts] == PLACEHOLDER]
        if not len(holes):
            return step
        if step.prev_step_id != self.step_id:
            raise FailedPrecondition(f"step {step.step_id} takes its tokens from step {step.prev_step_id}, but this "
                                     f"executor's last step is {self.step_id or 'none'} (a failed or missing step)")
        starts = np.zeros(len(step.query_lens) + 1, np.int64)
        np.cumsum(step.query_lens, out=starts[1:])
        row_of = np.searchsorted(starts, holes, side="right") - 1
        wanted = step.seq_ids[row_of]
        tokens = step.token_ids.copy()
        if np.array_equal(wanted, self._seq_ids):  # the same rows as the last step, in order
            tokens[holes] = self._tokens
        else:
            order = np.argsort(self._seq_ids, kind="stable")
            known = self._seq_ids[order]
            at = np.minimum(np.searchsorted(known, wanted), max(len(known) - 1, 0))
            found = known[at] == wanted if len(known) else np.zeros(len(wanted), bool)
            if not found.all():
                seq_id = int(wanted[np.argmin(found)])
                raise FailedPrecondition(f"sequence {seq_id} sampled no single token in step {self.step_id}: "
                                         "nothing to fill its placeholder with")
            tokens[holes] = self._tokens[order[at]]
        return dataclasses.replace(step, token_ids=tokens)
