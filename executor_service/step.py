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
    no top logprobs."""

    num_samples: np.ndarray | None = None       # int32 [n]
    temperature: np.ndarray | None = None       # float32 [n]
    top_p: np.ndarray | None = None             # float32 [n]; 0 read as 1
    top_k: np.ndarray | None = None             # int32 [n]
    seeds: np.ndarray | None = None             # int64 [sum(num_samples)]
    num_top_logprobs: np.ndarray | None = None  # int32 [n]
    return_logprobs: bool = False


@dataclass(slots=True)
class StepInput:
    step_id: int
    seq_ids: np.ndarray              # int64 [n]
    query_lens: np.ndarray           # int32 [n]
    token_ids: np.ndarray            # int32 [sum(query_lens)]
    table_epoch: int = 0             # the plan's; another one voids the tables first
    tables: TableChanges = field(default_factory=TableChanges)
    context_lens: np.ndarray | None = None  # int32 [n]: the gateway's count, checked against the tables
    incarnation: int = 0             # 0 = unchecked
    cache_ops: CacheOps = field(default_factory=CacheOps)
    sampling: Sampling = field(default_factory=Sampling)


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


def _check_distinct(arr: np.ndarray, name: str) -> None:
    if len(np.unique(arr)) != len(arr):
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
    num_samples = np.ones(n, np.int32) if s.num_samples is None else s.num_samples
    _check_len(num_samples, n, "sampling.num_samples")
    if n and (int(num_samples.min()) < 0 or int(num_samples.max()) > MAX_SAMPLES_PER_SEQ):
        _fail(f"sampling.num_samples must be in [0, {MAX_SAMPLES_PER_SEQ}]")
    num_total = int(num_samples.sum(dtype=np.int64))
    temperature = np.zeros(n, np.float32) if s.temperature is None else s.temperature
    top_p = np.ones(n, np.float32) if s.top_p is None else s.top_p
    top_k = np.zeros(n, np.int32) if s.top_k is None else s.top_k
    seeds = np.zeros(num_total, np.int64) if s.seeds is None else s.seeds
    num_top = np.zeros(n, np.int32) if s.num_top_logprobs is None else s.num_top_logprobs
    _check_len(temperature, n, "sampling.temperature")
    _check_len(top_p, n, "sampling.top_p")
    _check_len(top_k, n, "sampling.top_k")
    _check_len(num_top, n, "sampling.num_top_logprobs")
    _check_len(seeds, num_total, "sampling.seeds (one per sampled token)")
    if not np.all(np.isfinite(temperature)) or np.any(temperature < 0):
        _fail("sampling.temperature must be finite and >= 0")
    if not np.all(np.isfinite(top_p)) or np.any((top_p < 0) | (top_p > 1)):
        _fail("sampling.top_p must be in [0, 1] (0 = unset)")
    if n and (int(num_top.min()) < 0 or int(num_top.max()) > vocab_size):
        _fail(f"sampling.num_top_logprobs must be in [0, {vocab_size}]")
    top_p = np.where(top_p == 0, np.float32(1), top_p).astype(np.float32)
    return Sampling(num_samples, temperature, top_p, top_k, seeds, num_top, s.return_logprobs)


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
    if len(np.unique(step.seq_ids)) != n:
        _fail("seq_ids must be distinct")
    q = step.query_lens.astype(np.int64)
    if n and int(q.min()) < 1:
        _fail("query_lens must be >= 1")
    if n and int(q.max()) > limits.max_model_len:
        _fail(f"query_lens must be <= max_model_len {limits.max_model_len}")
    _check_len(step.token_ids, int(q.sum()), "token_ids (sum of query_lens)")
    _check_ids(step.token_ids, limits.vocab_size, "token_ids", "token")
    _check_cache_ops(step.cache_ops, limits)
    sampling = _normalized_sampling(step.sampling, n, limits.vocab_size)
    return dataclasses.replace(step, sampling=sampling)


def sampled_rows(step: StepInput) -> np.ndarray:
    """Indices of sequences that need logits (they sample or want top logprobs)."""
    s = step.sampling
    return np.nonzero((s.num_samples > 0) | (s.num_top_logprobs > 0))[0]


def build_forward_batch(step: StepInput, resolved: Resolved, device: torch.device) -> ForwardBatch:
    """Device tensors for a checked, resolved step."""
    q = step.query_lens.astype(np.int64)
    ctx = resolved.context_lens
    n, num_tokens = len(q), int(q.sum())
    qsl = np.zeros(n + 1, np.int64)
    np.cumsum(q, out=qsl[1:])
    seq_of = np.repeat(np.arange(n), q)
    positions = ctx[seq_of] + np.arange(num_tokens) - qsl[:-1][seq_of]
    logits_indices = qsl[1:][sampled_rows(step)] - 1

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    return ForwardBatch(
        input_ids=dev(step.token_ids, torch.int64),
        positions=dev(positions, torch.int64),
        slot_mapping=dev(resolved.slot_mapping, torch.int32),
        block_tables=dev(resolved.tables, torch.int32),
        seq_lens=dev(ctx + q, torch.int32),
        query_start_loc=dev(qsl, torch.int32),
        logits_indices=dev(logits_indices, torch.int64),
    )


def build_sampling_inputs(step: StepInput, resolved: Resolved, device: torch.device) -> SamplingInputs:
    """Sampling tensors for the rows ``sampled_rows(step)`` (same order as the logits)."""
    s = step.sampling
    rows = sampled_rows(step)

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    positions = resolved.context_lens + step.query_lens.astype(np.int64)
    return SamplingInputs(
        num_samples=dev(s.num_samples[rows], torch.int64),
        temperature=dev(s.temperature[rows], torch.float32),
        top_p=dev(s.top_p[rows], torch.float32),
        top_k=dev(s.top_k[rows], torch.int64),
        positions=dev(positions[rows], torch.int64),
        seeds=dev(s.seeds, torch.int64),
        num_top_logprobs=dev(s.num_top_logprobs[rows], torch.int64),
        return_logprobs=s.return_logprobs,
    )
