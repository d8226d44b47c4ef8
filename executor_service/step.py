"""One Execute step as domain data: decoded arrays, validation, input building.

Pure functions over numpy arrays (no grpc, no model): the servicer decodes
the proto's packed bytes into a ``StepInput``; ``check_step`` rejects
anything inconsistent BEFORE a tensor is touched (the block tables are the
executor's own, checked by ``tables.BlockTables.resolve``);
``build_forward_batch`` and ``build_sampling_inputs`` turn a checked,
resolved step into device tensors.

Rows follow ``seq_ids``. Token j of sequence s sits at absolute position
``context_len[s] + j`` (the tokens its table already holds) and goes to
slot ``table[s][pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from executor_service.model_runner import ForwardBatch
from executor_service.sampler import SamplingInputs
from executor_service.tables import Resolved, TableChanges
from kvpager.errors import FailedPrecondition, InvalidArgument

MAX_SAMPLES_PER_SEQ = 1024


def _i32(values=()) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


@dataclass(slots=True)
class CacheOps:
    """Block moves applied before the forward, in the order swap-out, swap-in, copy."""

    copy_src: np.ndarray = field(default_factory=_i32)      # device ids
    copy_dst: np.ndarray = field(default_factory=_i32)      # device ids
    swap_out_src: np.ndarray = field(default_factory=_i32)  # device ids
    swap_out_dst: np.ndarray = field(default_factory=_i32)  # swap ids
    swap_in_src: np.ndarray = field(default_factory=_i32)   # swap ids
    swap_in_dst: np.ndarray = field(default_factory=_i32)   # device ids

    @property
    def num_ops(self) -> int:
        return len(self.copy_src) + len(self.swap_out_src) + len(self.swap_in_src)


@dataclass(slots=True)
class Sampling:
    """Per-sequence sampling, columnar. ``None`` = the field was not sent:
    num_samples 1, temperature 0 (greedy), top_p 1, top_k off, seeds 0,
    no top logprobs; and (left None after checking) no penalty, min_p, logit
    bias or token history."""

    num_samples: np.ndarray | None = None       # int32 [n]
    temperature: np.ndarray | None = None       # float32 [n]
    top_p: np.ndarray | None = None             # float32 [n]; 0 read as 1
    top_k: np.ndarray | None = None             # int32 [n]
    seeds: np.ndarray | None = None             # int64 [sum(num_samples)]
    num_top_logprobs: np.ndarray | None = None  # int32 [n]
    return_logprobs: bool = False
    presence_penalty: np.ndarray | None = None    # float32 [n]; absent 0
    frequency_penalty: np.ndarray | None = None   # float32 [n]; absent 0
    repetition_penalty: np.ndarray | None = None  # float32 [n] > 0; absent 1
    min_p: np.ndarray | None = None               # float32 [n] in [0, 1]
    bias_offsets: np.ndarray | None = None        # int32 [n + 1] over bias_token_ids / bias_values
    bias_token_ids: np.ndarray | None = None      # int32
    bias_values: np.ndarray | None = None         # float32: finite or -inf
    prompt_lens: np.ndarray | None = None         # int32 [n]: prompt tokens of each row's sequence
    history_offsets: np.ndarray | None = None     # int32 [n + 1]: tokens in cache sent for a row (its start)
    history_token_ids: np.ndarray | None = None   # int32

    def penalized(self, n: int) -> np.ndarray | None:
        """bool [n]: the rows with a penalty (they keep a token history); None: no row has one."""
        if self.presence_penalty is None and self.frequency_penalty is None and self.repetition_penalty is None:
            return None
        mask = np.zeros(n, bool)
        if self.presence_penalty is not None:
            mask |= self.presence_penalty != 0
        if self.frequency_penalty is not None:
            mask |= self.frequency_penalty != 0
        if self.repetition_penalty is not None:
            mask |= self.repetition_penalty != 1
        return mask

    def history(self, i: int) -> np.ndarray | None:
        """The tokens in cache the request sent for row i (None: none sent)."""
        if self.history_offsets is None or self.history_offsets[i + 1] == self.history_offsets[i]:
            return None
        return self.history_token_ids[self.history_offsets[i]:self.history_offsets[i + 1]]


@dataclass(slots=True)
class StepInput:
    step_id: int
    seq_ids: np.ndarray              # int64 [n]
    query_lens: np.ndarray           # int32 [n]
    token_ids: np.ndarray            # int32 [sum(query_lens)]
    table_epoch: int = 0             # the plan's; another one voids the tables first
    tables: TableChanges = field(default_factory=TableChanges)
    # The hybrid KV layout: tables of groups 1, 2, … (starts and extends; forks and drops are ``tables``').
    group_tables: list[TableChanges] = field(default_factory=list)
    context_lens: np.ndarray | None = None  # int32 [n]: the gateway's count, checked against the tables
    incarnation: int = 0             # 0 = unchecked
    cache_ops: CacheOps = field(default_factory=CacheOps)
    sampling: Sampling = field(default_factory=Sampling)
    prev_step_id: int = 0  # the step whose samples fill its placeholders (-1); 0: none (executor_service.placeholders)
    # > 1: a decode burst of up to this many one-token forwards (executor_service.burst).
    decode_steps: int = 0


@dataclass(slots=True)
class StepOutput:
    step_id: int
    sampled_token_ids: np.ndarray        # int32 [sum(num_samples)]
    sampled_logprobs: np.ndarray | None  # float32 [sum(num_samples)]
    top_offsets: np.ndarray              # int32 [n + 1]
    top_token_ids: np.ndarray            # int32
    top_logprobs: np.ndarray             # float32
    forward_s: float = 0.0
    sample_s: float = 0.0
    cache_ops_s: float = 0.0
    sub_steps_run: int = 0  # a burst cut short: the sub-steps it ran (executor_service.burst); 0: not cut
    sub_step_carried: bool = False  # cut short, its next sub-step carried into the step that cut it (.carry)


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """What a step is checked against: this executor's pool and model."""

    num_blocks: int
    num_swap_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    incarnation: int


def _fail(msg: str) -> None:
    raise InvalidArgument(msg)


def _check_len(arr: np.ndarray, n: int, name: str) -> None:
    if len(arr) != n:
        _fail(f"{name}: expected {n} values, got {len(arr)}")


def _check_ids(arr: np.ndarray, limit: int, name: str, what: str) -> None:
    if len(arr) and (int(arr.min()) < 0 or int(arr.max()) >= limit):
        bad = arr[(arr < 0) | (arr >= limit)][0]
        _fail(f"{name}: {what} id {int(bad)} outside [0, {limit})")


def _distinct(arr: np.ndarray) -> bool:
    ordered = np.sort(arr)
    return not (ordered[1:] == ordered[:-1]).any()


def _check_distinct(arr: np.ndarray, name: str) -> None:
    if not _distinct(arr):
        _fail(f"{name}: ids must be distinct")


def _check_cache_ops(ops: CacheOps, limits: PoolLimits) -> None:
    if not ops.num_ops and not (len(ops.copy_dst) or len(ops.swap_out_dst) or len(ops.swap_in_dst)):
        return  # the usual step: nothing to move
    pairs = (
        ("copy", ops.copy_src, ops.copy_dst, limits.num_blocks, limits.num_blocks),
        ("swap_out", ops.swap_out_src, ops.swap_out_dst, limits.num_blocks, limits.num_swap_blocks),
        ("swap_in", ops.swap_in_src, ops.swap_in_dst, limits.num_swap_blocks, limits.num_blocks),
    )
    for name, src, dst, src_limit, dst_limit in pairs:
        if len(src) != len(dst):
            _fail(f"cache_ops.{name}: {len(src)} sources but {len(dst)} destinations")
        src_kind = "swap block" if name == "swap_in" else "block"
        dst_kind = "swap block" if name == "swap_out" else "block"
        _check_ids(src, src_limit, f"cache_ops.{name}_src", src_kind)
        _check_ids(dst, dst_limit, f"cache_ops.{name}_dst", dst_kind)
        _check_distinct(dst, f"cache_ops.{name}_dst")
    # The copy kernel reads and writes one pool in one launch.
    if np.intersect1d(ops.copy_src, ops.copy_dst).size:
        _fail("cache_ops.copy: a block is both a copy source and a destination")


def _normalized_sampling(s: Sampling, n: int, vocab_size: int) -> Sampling:
    """The defaults filled in; only the columns sent are checked (a default is valid)."""
    if s.num_samples is None:
        num_samples = np.ones(n, np.int32)
        num_total = n
    else:
        num_samples = s.num_samples
        _check_len(num_samples, n, "sampling.num_samples")
        if n and (int(num_samples.min()) < 0 or int(num_samples.max()) > MAX_SAMPLES_PER_SEQ):
            _fail(f"sampling.num_samples must be in [0, {MAX_SAMPLES_PER_SEQ}]")
        num_total = int(num_samples.sum(dtype=np.int64))
    temperature, top_p, top_k, num_top = s.temperature, s.top_p, s.top_k, s.num_top_logprobs
    if temperature is None:
        temperature = np.zeros(n, np.float32)
    else:
        _check_len(temperature, n, "sampling.temperature")
        if not np.isfinite(temperature).all() or (temperature < 0).any():
            _fail("sampling.temperature must be finite and >= 0")
    if top_p is None:
        top_p = np.ones(n, np.float32)
    else:
        _check_len(top_p, n, "sampling.top_p")
        if not np.isfinite(top_p).all() or ((top_p < 0) | (top_p > 1)).any():
            _fail("sampling.top_p must be in [0, 1] (0 = unset)")
        top_p = np.where(top_p == 0, np.float32(1), top_p).astype(np.float32)
    if top_k is None:
        top_k = np.zeros(n, np.int32)
    else:
        _check_len(top_k, n, "sampling.top_k")
    if num_top is None:
        num_top = np.zeros(n, np.int32)
    else:
        _check_len(num_top, n, "sampling.num_top_logprobs")
        if n and (int(num_top.min()) < 0 or int(num_top.max()) > vocab_size):
            _fail(f"sampling.num_top_logprobs must be in [0, {vocab_size}]")
    seeds = np.zeros(num_total, np.int64) if s.seeds is None else s.seeds
    _check_len(seeds, num_total, "sampling.seeds (one per sampled token)")
    out = Sampling(num_samples, temperature, top_p, top_k, seeds, num_top, s.return_logprobs)
    _check_processing(s, n, vocab_size)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "bias_offsets",
                 "bias_token_ids", "bias_values", "prompt_lens", "history_offsets", "history_token_ids"):
        setattr(out, name, getattr(s, name))
    return out


def _check_csr(offsets: np.ndarray | None, values: list[tuple[np.ndarray | None, str]], n: int, name: str) -> None:
    if offsets is None:
        for arr, field_name in values:
            if arr is not None and len(arr):
                _fail(f"sampling.{field_name} needs sampling.{name}_offsets")
        return
    total = len(values[0][0]) if values[0][0] is not None else 0
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0):
        _fail(f"sampling.{name}_offsets must rise from 0 to {total} over {n} rows")
    for arr, field_name in values:
        if (len(arr) if arr is not None else 0) != total:
            _fail(f"sampling.{field_name}: expected {total} values")


def _check_processing(s: Sampling, n: int, vocab_size: int) -> None:
    """The optional columns: penalties, min_p, logit bias, token histories."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "prompt_lens"):
        arr = getattr(s, name)
        if arr is not None:
            _check_len(arr, n, f"sampling.{name}")
    for name in ("presence_penalty", "frequency_penalty"):
        arr = getattr(s, name)
        if arr is not None and not np.all(np.isfinite(arr)):
            _fail(f"sampling.{name} must be finite")
    if s.repetition_penalty is not None and not (np.all(np.isfinite(s.repetition_penalty))
                                                 and np.all(s.repetition_penalty > 0)):
        _fail("sampling.repetition_penalty must be finite and > 0")
    if s.min_p is not None and not (np.all(np.isfinite(s.min_p)) and np.all((s.min_p >= 0) & (s.min_p <= 1))):
        _fail("sampling.min_p must be in [0, 1]")
    if s.prompt_lens is not None and n and int(s.prompt_lens.min()) < 0:
        _fail("sampling.prompt_lens must be >= 0")
    _check_csr(s.bias_offsets, [(s.bias_token_ids, "logit_bias_token_ids"), (s.bias_values, "logit_bias_values")],
               n, "logit_bias")
    if s.bias_offsets is not None:
        _check_ids(s.bias_token_ids, vocab_size, "sampling.logit_bias_token_ids", "token")
        v = s.bias_values
        if np.any(np.isnan(v) | (v == np.inf)):
            _fail("sampling.logit_bias_values must be finite or -inf")
        rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(s.bias_offsets))
        if len(np.unique(rows * vocab_size + s.bias_token_ids)) != len(rows):
            _fail("sampling.logit_bias_token_ids must be distinct within a row")
    _check_csr(s.history_offsets, [(s.history_token_ids, "history_token_ids")], n, "history")
    if s.history_offsets is not None:
        _check_ids(s.history_token_ids, vocab_size, "sampling.history_token_ids", "token")
        sent = np.diff(s.history_offsets) > 0
        penalized = s.penalized(n)
        if np.any(sent & ~(penalized if penalized is not None else np.zeros(n, bool))):
            _fail("sampling.history: tokens sent for a row without a penalty (only penalised rows keep one)")


def check_step(step: StepInput, limits: PoolLimits) -> StepInput:
    """Validate everything but the tables; return the step with sampling defaults filled in.

    Raises:
        FailedPrecondition: the plan was made for another incarnation.
        InvalidArgument: anything else inconsistent or out of range.
    """
    if step.incarnation and step.incarnation != limits.incarnation:
        raise FailedPrecondition(
            f"plan for incarnation {step.incarnation}, this executor is {limits.incarnation}"
        )
    n = len(step.seq_ids)
    _check_len(step.query_lens, n, "query_lens")
    if step.context_lens is not None:
        _check_len(step.context_lens, n, "context_lens")
    if not _distinct(step.seq_ids):
        _fail("seq_ids must be distinct")
    q = step.query_lens.astype(np.int64)
    if n and int(q.min()) < 1:
        _fail("query_lens must be >= 1")
    if n and int(q.max()) > limits.max_model_len:
        _fail(f"query_lens must be <= max_model_len {limits.max_model_len}")
    _check_len(step.token_ids, int(q.sum()), "token_ids (sum of query_lens)")
    tokens = step.token_ids
    if step.decode_steps > 1:  # a burst's placeholders: executor_service.burst.check_burst
        tokens = tokens[tokens != -1]
    elif step.prev_step_id and len(tokens) and int(tokens.min()) == -1:
        from executor_service.placeholders import PLACEHOLDER, check_placeholders

        check_placeholders(step)
        tokens = tokens[tokens != PLACEHOLDER]
    _check_ids(tokens, limits.vocab_size, "token_ids", "token")
    _check_cache_ops(step.cache_ops, limits)
    sampling = _normalized_sampling(step.sampling, n, limits.vocab_size)
    return dataclasses.replace(step, sampling=sampling)


def _writable(a: np.ndarray) -> np.ndarray:
    """Contiguous and writable: a request column is a read-only view of its payload,
    which torch must not share."""
    a = np.ascontiguousarray(a)
    return a if a.flags.writeable else a.copy()


def sampled_rows(step: StepInput) -> np.ndarray:
    """Indices of sequences that need logits (they sample or want top logprobs)."""
    s = step.sampling
    return np.nonzero((s.num_samples > 0) | (s.num_top_logprobs > 0))[0]


def build_forward_batch(step: StepInput, resolved: Resolved, device: torch.device,
                        groups: list[Resolved] | None = None) -> ForwardBatch:
    """Device tensors for a checked, resolved step. groups: the resolved
    tables of every table group (the hybrid layout; group 0 is ``resolved``)."""
    q = step.query_lens.astype(np.int64)
    ctx = resolved.context_lens
    n, num_tokens = len(q), int(q.sum())
    qsl = np.zeros(n + 1, np.int64)
    np.cumsum(q, out=qsl[1:])
    seq_of = np.repeat(np.arange(n), q)
    positions = ctx[seq_of] + np.arange(num_tokens) - qsl[:-1][seq_of]
    logits_indices = qsl[1:][sampled_rows(step)] - 1

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(_writable(a)).to(device=device, dtype=dtype)

    groups = groups or [resolved]
    tables = [dev(r.tables, torch.int32) for r in groups]
    slots = [dev(r.slot_mapping, torch.int32) for r in groups]
    return ForwardBatch(
        group_block_tables=tables,
        group_slot_mappings=slots,
        input_ids=dev(step.token_ids, torch.int64),
        positions=dev(positions, torch.int64),
        slot_mapping=slots[0],
        block_tables=tables[0],
        seq_lens=dev(ctx + q, torch.int32),
        query_start_loc=dev(qsl, torch.int32),
        logits_indices=dev(logits_indices, torch.int64),
    )


def build_sampling_inputs(step: StepInput, resolved: Resolved, device: torch.device,
                          histories: dict[int, np.ndarray] | None = None) -> SamplingInputs:
    """Sampling tensors for the rows ``sampled_rows(step)`` (same order as the logits).

    histories: row index -> that penalised row's tokens through this step
    (``history.TokenHistories.resolve``); needed when a sampled row has a penalty.
    """
    s = step.sampling
    rows = sampled_rows(step)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(_writable(a)).to(device=device, dtype=dtype)

    positions = resolved.context_lens + step.query_lens.astype(np.int64)
    inputs = SamplingInputs(
        num_samples=dev(s.num_samples[rows], torch.int64),
        temperature=dev(s.temperature[rows], torch.float32),
        top_p=dev(s.top_p[rows], torch.float32),
        top_k=dev(s.top_k[rows], torch.int64),
        positions=dev(positions[rows], torch.int64),
        seeds=dev(s.seeds, torch.int64),
        num_top_logprobs=dev(s.num_top_logprobs[rows], torch.int64),
        return_logprobs=s.return_logprobs,
    )
    if s.min_p is not None and np.any(s.min_p[rows] > 0):
        inputs.min_p = dev(s.min_p[rows], torch.float32)
    n = len(step.seq_ids)
    if s.bias_offsets is not None and len(s.bias_token_ids):
        place = np.full(n, -1, np.int64)  # a sequence's row among the logits rows
        place[rows] = np.arange(len(rows))
        entry_rows = place[np.repeat(np.arange(n), np.diff(s.bias_offsets))]
        keep = entry_rows >= 0
        inputs.bias_rows = dev(entry_rows[keep], torch.int64)
        inputs.bias_token_ids = dev(s.bias_token_ids[keep], torch.int64)
        inputs.bias_values = dev(s.bias_values[keep], torch.float32)
    penalized = s.penalized(n)
    if penalized is not None and np.any(penalized[rows]):
        at = np.nonzero(penalized[rows])[0]  # among the logits rows
        tokens = [histories[int(rows[j])] for j in at]
        lens = np.array([len(t) for t in tokens], np.int64)
        prompt = (s.prompt_lens[rows[at]].astype(np.int64) if s.prompt_lens is not None
                  else np.zeros(len(at), np.int64))
        index = np.repeat(np.arange(len(at)), lens)
        offset = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        inputs.penalty_rows = dev(at, torch.int64)

        def col(arr: np.ndarray | None, default: float) -> torch.Tensor:
            return dev(arr[rows[at]] if arr is not None else np.full(len(at), default, np.float32), torch.float32)

        inputs.presence_penalty = col(s.presence_penalty, 0.0)
        inputs.frequency_penalty = col(s.frequency_penalty, 0.0)
        inputs.repetition_penalty = col(s.repetition_penalty, 1.0)
        inputs.history_index = dev(index, torch.int64)
        inputs.history_token_ids = dev(np.concatenate(tokens) if tokens else np.zeros(0, np.int32), torch.int64)
        inputs.history_is_output = dev(offset >= prompt[index], torch.bool)
    return inputs
