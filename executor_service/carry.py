"""A cut burst's next sub-step, carried into the step that cut it.

A decode burst is cut short when a step waits behind it (``cut_prev``: a
prefill, mostly; executor_service.burst). Its rows then got their next
token only from a decode step after the one that cut it: that step ran
alone, and a running stream waited for its whole forward, the hand-over and
a decode forward of its own (traced on a 2-core machine at 8 requests/s,
docs/benchmarks.md: ~3.5 ms more than the prefill, where vLLM runs a new
prefill in the same forward as the running decodes).

So the burst hands the sub-step it would have run next (its rows still
going, one token each: the sample before it, at the next position, into
the slot the burst's plan reserved for it) to the step that cut it, which
computes it in its own forward after its own rows. The burst answers the
sub-steps it ran and says the next one is carried; the tables count the
carried token as computed at once; the cutting step returns the carried
rows' samples after its own rows' and records them as last samples, so a
step planned behind it feeds them. Sampling is keyed by (seed, position):
the carried sub-step samples exactly what the burst would have.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from executor_service.placeholders import PLACEHOLDER
from executor_service.step import Sampling, StepInput, StepOutput
from executor_service.tables import Resolved


@dataclasses.dataclass(slots=True)
class Carry:
    """A cut burst's next sub-step (``burst.sub_step``: one token per row, no
    cache ops, sampling without penalties or top logprobs)."""

    step_id: int          # the burst's
    step: StepInput       # its rows (seq_ids, one token each) and sampling
    view: Resolved        # their tables, positions and reserved slots (one table group: grouped executors never cut)


def subset_sampling(s: Sampling, rows: np.ndarray) -> Sampling:
    """The columns of ``rows`` (every one samples one token: seeds are per row;
    no penalties: a burst's later sub-steps, and its carried one, have none)."""
    def pick(a):
        return None if a is None else a[rows]

    bias_offsets = bias_ids = bias_values = None
    if s.bias_offsets is not None:
        lo, hi = s.bias_offsets[rows], s.bias_offsets[rows + 1]
        lens = (hi - lo).astype(np.int64)
        take = np.repeat(lo.astype(np.int64) - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) \
            + np.arange(int(lens.sum()))
        bias_offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
        bias_ids, bias_values = s.bias_token_ids[take], s.bias_values[take]
    return Sampling(
        num_samples=s.num_samples[rows], temperature=s.temperature[rows], top_p=s.top_p[rows],
        top_k=s.top_k[rows], seeds=s.seeds[rows], num_top_logprobs=s.num_top_logprobs[rows],
        return_logprobs=s.return_logprobs, min_p=pick(s.min_p),
        bias_offsets=bias_offsets, bias_token_ids=bias_ids, bias_values=bias_values)


def _column(a: np.ndarray | None, n_a: int, b: np.ndarray | None, n_b: int, default, dtype) -> np.ndarray | None:
    """a [n_a] then b [n_b]; an absent side takes ``default``; both absent: None."""
    if a is None and b is None:
        return None
    a = np.full(n_a, default, dtype) if a is None else a
    b = np.full(n_b, default, dtype) if b is None else b
    return np.concatenate([a, b]).astype(dtype, copy=False)


def _offsets(offsets_a: np.ndarray | None, n_a: int, offsets_b: np.ndarray | None, n_b: int) -> np.ndarray:
    """Row offsets [n_a + n_b + 1] over a's entries then b's (an absent side: none)."""
    oa = np.zeros(n_a + 1, np.int64) if offsets_a is None else offsets_a.astype(np.int64)
    ob = np.zeros(n_b + 1, np.int64) if offsets_b is None else offsets_b.astype(np.int64)
    return np.concatenate([oa, ob[1:] + oa[-1]]).astype(np.int32)


def _entries(a: np.ndarray | None, b: np.ndarray | None, dtype) -> np.ndarray:
    return np.concatenate([np.zeros(0, dtype) if x is None else x for x in (a, b)]).astype(dtype, copy=False)


def concat_sampling(a: Sampling, n_a: int, b: Sampling, n_b: int) -> Sampling:
    """The sampling of a's ``n_a`` rows followed by b's ``n_b`` (both checked:
    their required columns filled in)."""
    biased = a.bias_offsets is not None or b.bias_offsets is not None
    histories = a.history_offsets is not None or b.history_offsets is not None
    return Sampling(
        num_samples=np.concatenate([a.num_samples, b.num_samples]),
        temperature=np.concatenate([a.temperature, b.temperature]),
        top_p=np.concatenate([a.top_p, b.top_p]),
        top_k=np.concatenate([a.top_k, b.top_k]),
        seeds=np.concatenate([a.seeds, b.seeds]),
        num_top_logprobs=np.concatenate([a.num_top_logprobs, b.num_top_logprobs]),
        return_logprobs=a.return_logprobs or b.return_logprobs,
        presence_penalty=_column(a.presence_penalty, n_a, b.presence_penalty, n_b, 0.0, np.float32),
        frequency_penalty=_column(a.frequency_penalty, n_a, b.frequency_penalty, n_b, 0.0, np.float32),
        repetition_penalty=_column(a.repetition_penalty, n_a, b.repetition_penalty, n_b, 1.0, np.float32),
        min_p=_column(a.min_p, n_a, b.min_p, n_b, 0.0, np.float32),
        bias_offsets=_offsets(a.bias_offsets, n_a, b.bias_offsets, n_b) if biased else None,
        bias_token_ids=_entries(a.bias_token_ids, b.bias_token_ids, np.int32) if biased else None,
        bias_values=_entries(a.bias_values, b.bias_values, np.float32) if biased else None,
        prompt_lens=_column(a.prompt_lens, n_a, b.prompt_lens, n_b, 0, np.int32),
        history_offsets=_offsets(a.history_offsets, n_a, b.history_offsets, n_b) if histories else None,
        history_token_ids=_entries(a.history_token_ids, b.history_token_ids, np.int32) if histories else None)


def _pad(tables: np.ndarray, width: int) -> np.ndarray:
    if tables.shape[1] >= width:
        return tables
    return np.pad(tables, ((0, 0), (0, width - tables.shape[1])))  # block 0: the padding ``resolve`` uses


def merge(step: StepInput, resolved: Resolved, carry: Carry) -> tuple[StepInput, Resolved, np.ndarray]:
    """The checked, resolved step that cut a burst with the carried sub-step's
    rows after its own: one forward computes both (the step's cache ops go
    first, as ever; the carried rows have none). A carried row whose
    sequence this step's plan drops (it ended, or was aborted, while the
    burst ran) is left out: the memory service may have given its slot to a
    row of this very step. Returns the merged step, its tables, and which
    carried rows it kept (bool [len(carry rows)]: ``answer`` fills the rest)."""
    c = carry.step
    kept = ~np.isin(c.seq_ids, step.tables.dropped) if len(step.tables.dropped) else np.ones(len(c.seq_ids), bool)
    rows = np.nonzero(kept)[0]
    n, m = len(step.seq_ids), len(rows)
    merged = dataclasses.replace(
        step, seq_ids=np.concatenate([step.seq_ids, c.seq_ids[rows]]),
        query_lens=np.concatenate([step.query_lens, c.query_lens[rows]]).astype(step.query_lens.dtype),
        token_ids=np.concatenate([step.token_ids, c.token_ids[rows]]).astype(np.int32),
        context_lens=None, sampling=concat_sampling(step.sampling, n, subset_sampling(c.sampling, rows), m))
    v = carry.view
    width = max(resolved.tables.shape[1], v.tables.shape[1])
    view = Resolved(reset=resolved.reset, epoch=resolved.epoch, staged=resolved.staged,
                    row_ids=np.concatenate([resolved.row_ids, v.row_ids[rows]]),
                    context_lens=np.concatenate([resolved.context_lens, v.context_lens[rows]]).astype(np.int64),
                    tables=np.concatenate([_pad(resolved.tables, width), _pad(v.tables[rows], width)]).astype(np.int32),
                    slot_mapping=np.concatenate([resolved.slot_mapping, v.slot_mapping[rows]]).astype(np.int32))
    return merged, view, kept


def answer(out: StepOutput, kept: np.ndarray) -> StepOutput:
    """The merged forward's output as the step that cut the burst answers it:
    one sample per carried row, PLACEHOLDER (-1, never computed) for a row
    ``merge`` left out, and top offsets counting every carried row."""
    if kept.all():
        return out
    m = len(kept)
    own = len(out.sampled_token_ids) - int(kept.sum())  # the carried rows' samples are the last ones
    tokens = np.full(own + m, PLACEHOLDER, np.int32)
    tokens[:own] = out.sampled_token_ids[:own]
    tokens[own + np.nonzero(kept)[0]] = out.sampled_token_ids[own:]
    logprobs = None
    if out.sampled_logprobs is not None:
        logprobs = np.zeros(own + m, np.float32)
        logprobs[:own] = out.sampled_logprobs[:own]
        logprobs[own + np.nonzero(kept)[0]] = out.sampled_logprobs[own:]
    offsets = np.concatenate([out.top_offsets, np.full(m - int(kept.sum()), out.top_offsets[-1], np.int32)])
    return dataclasses.replace(out, sampled_token_ids=tokens, sampled_logprobs=logprobs, top_offsets=offsets)
