"""A decode burst: one Execute that runs several one-token decode forwards.

With ``--num-scheduler-steps K`` the gateway plans up to K tokens for each
running decode at once (``StepInput.decode_steps``); the memory service
allocates their slots in one plan. Row i's ``query_lens[i]`` tokens are its
first (known, or a placeholder of the step before) followed by placeholders
this step samples itself. The executor resolves and commits the tables for
the whole burst once, then runs sub-step j = 0, 1, … over the rows still
going (``query_lens > j``), each fed the token its sub-step j - 1 sampled,
at position ``context_len + j``. Sampling is keyed by (seed, position), so a
burst samples exactly what the same decodes one step at a time would.

Sub-step 0 is the whole step (every row, its cache ops, its penalties and
top logprobs); later sub-steps carry only burst rows, which sample one token
without penalties or top logprobs (checked: ``check_burst``). Outputs come
back row-major: row i's ``query_lens[i]`` samples in order; a caller may
also take each sub-step's samples as it ends (``on_part``: ExecuteStream,
so the gateway streams tokens the moment they are sampled).

A burst may be cut short (``stop``: a later step is waiting behind it, sent
with ``cut_prev``): J sub-steps run, and row i returns min(query_lens[i], J)
samples. Sub-step J, for the rows still going in it, is then carried into
the step that cut it, which computes it in its own forward
(executor_service.carry): the tables count those rows' J + 1 tokens as
computed, and give back the slots past them. A cut heard between two
sub-steps ends the burst before the finished one's samples go out as a
part (J counts it: its samples come in the whole response); one heard
during a sub-step's forward ends that forward before its next layer (on
an eager forward: a replayed CUDA graph runs whole), and J counts only the
sub-steps before it, whose parts may have gone out already: the stopped
forward wrote K/V only into the slots of its rows' next token, which the
carried sub-step writes again, so a cut waits for one layer instead of the
rest of a forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from executor_service.carry import Carry, subset_sampling
from executor_service.models import ForwardStopped
from executor_service.placeholders import PLACEHOLDER
from executor_service.step import CacheOps, StepInput, StepOutput
from executor_service.tables import Resolved
from kvpager.errors import InvalidArgument

MAX_DECODE_STEPS = 64


def row_starts(query_lens: np.ndarray) -> np.ndarray:
    """int64 [n + 1]: where each row's tokens begin in the flattened step."""
    starts = np.zeros(len(query_lens) + 1, np.int64)
    np.cumsum(query_lens, out=starts[1:])
    return starts


def check_burst(step: StepInput) -> None:
    """A burst's rows are decodes: their tokens after the first are
    placeholders; a row of more than one token samples one token per
    sub-step with neither penalties nor top logprobs; a placeholder first
    token needs prev_step_id. ``step.sampling`` is normalized (``check_step``)."""
    k = step.decode_steps
    if k > MAX_DECODE_STEPS:
        raise InvalidArgument(f"decode_steps must be <= {MAX_DECODE_STEPS}, got {k}")
    q = step.query_lens
    if len(q) and int(q.max()) > k:
        raise InvalidArgument(f"query_lens: a decode burst of {k} steps computes at most {k} tokens per row")
    starts = row_starts(q)
    firsts = np.zeros(len(step.token_ids), bool)
    firsts[starts[:-1]] = True
    tokens = step.token_ids
    if (tokens[~firsts] != PLACEHOLDER).any():
        raise InvalidArgument("token_ids: in a decode burst a row's tokens after its first are placeholders (-1)")
    if (tokens[firsts] == PLACEHOLDER).any() and not step.prev_step_id:
        raise InvalidArgument("token_ids: a placeholder (-1) first token needs prev_step_id, the step that samples it")
    s = step.sampling
    if (s.num_samples != 1).any():
        raise InvalidArgument("sampling.num_samples: every row of a decode burst samples one token")
    multi = q > 1
    penalized = s.penalized(len(q))
    if (s.num_top_logprobs[multi] > 0).any() or (penalized is not None and penalized[multi].any()):
        raise InvalidArgument("sampling: a row of more than one token in a decode burst cannot ask for top "
                              "logprobs or penalties")


def sub_step(step: StepInput, groups: list[Resolved], j: int, tokens: np.ndarray
             ) -> tuple[StepInput, list[Resolved], np.ndarray]:
    """Sub-step j of a checked, resolved burst: the rows still going
    (``query_lens > j``), one token each (``tokens``, int32 [len(rows)]), at
    context ``context_len + j``. ``groups``: the resolved tables of each KV
    table group (group 0 first). Returns the one-token step, its tables per
    group and the rows (indices into the burst's rows)."""
    q = step.query_lens
    rows = np.arange(len(q)) if j == 0 else np.nonzero(q > j)[0]
    at = row_starts(q)[rows] + j
    one = np.ones(len(rows), np.int32)
    sub = dataclasses.replace(
        step, seq_ids=step.seq_ids[rows], query_lens=one, token_ids=np.ascontiguousarray(tokens, np.int32),
        context_lens=None, decode_steps=0, prev_step_id=0,
        cache_ops=step.cache_ops if j == 0 else CacheOps(),
        sampling=step.sampling if j == 0 else subset_sampling(step.sampling, rows))
    views = [Resolved(reset=r.reset, epoch=r.epoch, staged={}, row_ids=r.row_ids[rows],
                      context_lens=r.context_lens[rows] + j, tables=r.tables[rows],
                      slot_mapping=r.slot_mapping[at])
             for r in groups]
    return sub, views, rows


def gather(step: StepInput, parts: list[tuple[np.ndarray, StepOutput]], forward_s: float, sample_s: float,
           cache_ops_s: float) -> StepOutput:
    """The burst's output from its sub-steps' (rows, output): samples row-major
    (row i's ``query_lens[i]`` in order, or as many as ran when cut short),
    top logprobs from sub-step 0 (the only one that may ask for them)."""
    q = step.query_lens
    cut = len(parts) if len(q) and len(parts) < int(q.max()) else 0
    if cut:
        q = np.minimum(q, cut)
    starts = row_starts(q)
    tokens = np.zeros(int(starts[-1]), np.int32)
    logprobs = np.zeros(int(starts[-1]), np.float32) if step.sampling.return_logprobs else None
    for j, (rows, out) in enumerate(parts):
        at = starts[rows] + j
        tokens[at] = out.sampled_token_ids
        if logprobs is not None:
            logprobs[at] = out.sampled_logprobs
    first = parts[0][1]
    return StepOutput(step_id=step.step_id, sampled_token_ids=tokens, sampled_logprobs=logprobs,
                      top_offsets=first.top_offsets, top_token_ids=first.top_token_ids,
                      top_logprobs=first.top_logprobs, forward_s=forward_s, sample_s=sample_s,
                      cache_ops_s=cache_ops_s, sub_steps_run=cut)


def run_lens(step: StepInput, out: StepOutput) -> np.ndarray:
    """int32 [n]: the tokens each row computed (and sampled): its query_lens,
    or fewer when the burst was cut short."""
    q = step.query_lens
    return np.minimum(q, out.sub_steps_run).astype(q.dtype) if out.sub_steps_run else q


def computed_lens(step: StepInput, out: StepOutput) -> np.ndarray:
    """int32 [n]: the tokens each row's table counts as computed: those it
    ran, and one more where its next sub-step was carried into the step
    that cut the burst (executor_service.carry)."""
    lens = run_lens(step, out)
    if out.sub_step_carried:
        lens = lens + (step.query_lens > out.sub_steps_run).astype(lens.dtype)
    return lens


def last_samples(step: StepInput, out: StepOutput) -> np.ndarray:
    """int32 [n]: each row's last sample (what a step planned ahead feeds it)."""
    return out.sampled_token_ids[row_starts(run_lens(step, out))[1:] - 1]


# on_part(j, out): sub-step j (not the last) ended; out: the samples of the rows still going in it, in row order.
OnPart = Callable[[int, StepOutput], None]


def run(step: StepInput, groups: list[Resolved], histories: dict,
        run_one: Callable[[StepInput, Resolved, dict, list[Resolved], Callable[[], bool] | None], StepOutput],
        on_part: OnPart | None = None, stop: Callable[[], bool] | None = None) -> tuple[StepOutput, Carry | None]:
    """A checked, resolved and committed burst: ``run_one`` (the executor's
    one-forward step: cache ops, forward, sampling; its last argument asked
    before each layer, ``models.ForwardStopped`` when it said stop) on each
    sub-step while any row has tokens left, each fed what the one before
    sampled; ``on_part`` hears of every sub-step but the last as it ends (the
    last one's samples are in the returned whole). ``stop``: asked after each
    sub-step but the last, before its part goes out, and before each layer
    of every sub-step but the first; true cuts the burst short there, and
    the sub-step it would have run next is returned, to be carried into the
    step that cut it (executor_service.carry; None: not cut, or on an
    executor with a table per KV group, which never cuts)."""
    q = step.query_lens
    tokens = step.token_ids[row_starts(q)[:-1]]  # every row's first token
    parts: list[tuple[np.ndarray, StepOutput]] = []
    forward_s = sample_s = cache_ops_s = 0.0
    last = int(q.max()) - 1 if len(q) else -1
    carry = None
    for j in range(last + 1):
        sub, (head, *rest), rows = sub_step(step, groups, j, tokens)
        try:  # sub-step 0 (the whole step's cache ops, penalties, top logprobs) always runs
            out = run_one(sub, head, histories if j == 0 else {}, rest, stop if j else None)
        except ForwardStopped:
            # Cut between two layers of sub-step j: j ran (it wrote only its own slots); the step that cut it runs j.
            carry = None if rest else Carry(step.step_id, sub, head)
            break
        parts.append((rows, out))
        forward_s += out.forward_s
        sample_s += out.sample_s
        cache_ops_s += out.cache_ops_s
        tokens = out.sampled_token_ids[q[rows] > j + 1]  # the rows that feed their sample into sub-step j + 1
        if j < last and stop is not None and stop():
            nxt, (view, *rest), _ = sub_step(step, groups, j + 1, tokens)
            carry = None if rest else Carry(step.step_id, nxt, view)  # the step that cut it runs j + 1
            break
        if on_part is not None and j < last:
            on_part(j, out)
    out = gather(step, parts, forward_s, sample_s, cache_ops_s)
    out.sub_step_carried = carry is not None
    return out, carry
