"""Pure builders between the engine's records and the wire messages.

The engine decides (what to schedule, how each row samples); these turn its
decisions and the memory service's plan into StepRequest / ExecuteRequest
messages and the replies back into typed records. No state, no I/O.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpager.errors import InvalidArgument, KvpagerError, ResourceExhausted
from kvpager.packed import array_bytes, pack_i32, pack_i64, unpack_f32, unpack_i32, unpack_i64
from kvpager.prefix_index.hashing import pack_hashes
from kvpager.v1 import common_pb2, executor_pb2, memory_pb2
from gateway.clients import ExecutorClient
from gateway.scheduling import Batch
from gateway.sequences import Changes
from gateway.state import PLACEHOLDER, Seq  # noqa: F401 (wire.PLACEHOLDER: what rows send)

# Seeds travel as int64: a client's uint64 seed (+ completion index) is taken
# modulo 2**63 (an unmasked 2**63 overflowed the step and failed every request).
SEED_MASK = (1 << 63) - 1


# ---- the Step ---------------------------------------------------------------------------


def new_sequence(seq: Seq, ex: ExecutorClient) -> memory_pb2.NewSequence:
    """A sequence the memory service does not know yet, with its prompt's block
    hashes in the executor's namespace (the request's chain: hashed once)."""
    req = seq.request
    hashes = b""
    if req.chain is not None and len(seq.tokens) == len(req.prompt_ids):
        hashes = pack_hashes(req.chain.hashes(ex.namespace, ex.block_size))
    return memory_pb2.NewSequence(
        seq_id=seq.seq_id, executor_id=seq.executor_id, prompt_token_ids=pack_i32(seq.tokens),
        priority=req.priority, cache_salt=req.cache_salt,
        max_total_tokens=len(req.prompt_ids) + req.spec.max_tokens, prompt_block_hashes=hashes,
        request_id=req.request_id, tenant=req.tenant, retention_s=req.retention_s)


def step_request(step_id: int, changes: Changes, batch: Batch,
                 executors: dict[str, ExecutorClient], pending: list[int] = ()) -> memory_pb2.StepRequest:
    """``pending``: sequences whose next token a step in flight is sampling
    and that this step feeds (placeholders at the memory service);
    ``batch.lookahead``: tokens each samples ahead (a decode burst)."""
    app = list(changes.appends)
    appended = None
    if app:
        toks = [changes.appends[s] for s in app]
        if all(len(t) == 1 for t in toks):
            offsets, flat = range(len(app) + 1), (t[0] for t in toks)
        else:  # a sequence whose results of two steps came in before a Step (planned ahead)
            offsets = [0]
            for t in toks:
                offsets.append(offsets[-1] + len(t))
            flat = (x for t in toks for x in t)
        appended = common_pb2.TokenBatch(seq_ids=pack_i64(app), offsets=pack_i32(offsets), token_ids=pack_i32(flat))
    return memory_pb2.StepRequest(
        step_id=step_id, appended=appended,
        forks=[common_pb2.ForkOp(parent_seq_id=p, child_seq_ids=c) for p, c in changes.forks],
        free_seq_ids=pack_i64(changes.free), abort_seq_ids=pack_i64(changes.abort),
        new_sequences=[new_sequence(s, executors[s.executor_id]) for s in batch.new],
        schedule_seq_ids=pack_i64(s.seq_id for s in batch.seqs), schedule_num_tokens=pack_i32(batch.num_tokens),
        pending_seq_ids=pack_i64(pending), schedule_lookahead=pack_i32(batch.lookahead),
        cut_seq_ids=pack_i64(changes.cut), carried_seq_ids=pack_i64(changes.carried))


# ---- the plan ---------------------------------------------------------------------------


@dataclass(slots=True)
class Rejection:
    seq_id: int
    error: KvpagerError


_REJECTIONS = {common_pb2.REJECTION_REASON_OVER_CONTEXT_LIMIT: InvalidArgument,
               common_pb2.REJECTION_REASON_OVER_POOL: ResourceExhausted,
               common_pb2.REJECTION_REASON_OVER_QUOTA: ResourceExhausted}


def rejections(plan: memory_pb2.StepPlan) -> list[Rejection]:
    """New sequences the memory service refused, with the error their requests end with."""
    return [Rejection(r.seq_id, _REJECTIONS.get(r.reason, InvalidArgument)(r.message)) for r in plan.rejected]


def preemptions(plan: memory_pb2.StepPlan) -> list[tuple[int, bool]]:
    """(seq_id, swapped) of the sequences that lost their device blocks this step."""
    return [(p.seq_id, p.mode == common_pb2.PREEMPTION_MODE_SWAP) for p in plan.preempted]


@dataclass(slots=True)
class PlanRow:
    """One row of an executor's plan, as the engine needs it."""

    seq_id: int
    start: int          # tokens already in cache
    num_tokens: int     # computed now
    cached: int         # prefix-cache hit of its first admission (0 otherwise)
    started: bool = False  # admitted or swapped in by this plan (the executor has no state of it before)


def plan_rows(plan: common_pb2.ExecutorPlan, computed: Callable[[int], int]) -> list[PlanRow]:
    """The plan's rows. A started sequence (admitted, swapped in) starts where
    the plan says; any other continues from what the gateway counted as
    computed (``computed(seq_id)``, in tokens): the executor checks the two agree."""
    t = plan.tables
    starts = {}
    if t.started_seq_ids:
        ctx, cached = unpack_i32(t.started_context_lens), unpack_i32(plan.started_cached_tokens)
        for i, seq_id in enumerate(unpack_i64(t.started_seq_ids)):
            starts[seq_id] = (ctx[i], cached[i] if i < len(cached) else 0)
    rows = []
    for seq_id, q in zip(unpack_i64(plan.seq_ids), unpack_i32(plan.query_lens)):
        started = starts.get(seq_id)
        if started is not None:
            rows.append(PlanRow(seq_id, started[0], q, started[1], True))
        else:
            rows.append(PlanRow(seq_id, computed(seq_id), q, 0))
    return rows


def has_work(plan: common_pb2.ExecutorPlan) -> bool:
    """Rows, or cache ops alone (a swap-out of a preempted sequence must still run)."""
    ops = plan.cache_ops
    return bool(plan.seq_ids or ops.copy_src or ops.swap_out_src or ops.swap_in_src)


# ---- Execute ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    """One executor row: its sequence, the tokens computed now, how it samples."""

    seq: Seq
    start: int                                        # tokens in cache before this step
    token_ids: list[int]
    num_samples: int = 0                              # tokens to sample (0: mid-prefill, or top-k only)
    num_top: int = 0                                  # top logprobs to return (beam search, top_logprobs)
    seeds: list[int] = field(default_factory=list)    # one per sampled token
    bias: tuple[tuple[int, float], ...] = ()          # logit bias of this row's draw
    history: list[int] | None = None                  # penalised start: its tokens in cache, sent once
    burst: int = 0                                    # tokens sampled ahead (a decode burst): 1 + burst come back
    taken: int = 0                                    # of them, taken already from a streamed burst's sub-steps
    carried: bool = False                             # a cut burst's next sub-step, run by the step that cut it
    rest: int = 0                                     # carried: tokens its burst had planned past it


def execute_request(step_id: int, incarnation: int, plan: common_pb2.ExecutorPlan,
                    rows: list[Row], prev_step_id: int = 0, cut_prev: bool = False) -> executor_pb2.ExecuteRequest:
    """The executor's part of the plan (passed through untouched: rows, table
    changes, cache ops), with token ids, context lengths and sampling added.
    ``prev_step_id``: the step in flight on this executor before this one (0:
    none), whose samples fill the placeholders, and which the executor runs
    first in any case (a step sent while the one before waits for its own
    predecessor must not overtake it). ``cut_prev``: that step is a decode
    burst this one may cut short (gateway.bursts)."""
    tokens, starts = array("i"), array("i")
    num_samples, temps, top_ps, top_ks, seeds, tops = (array("i"), array("f"), array("f"), array("i"),
                                                        array("q"), array("i"))
    want_logprobs = processed = False
    burst = 0
    for row in rows:
        burst = max(burst, row.burst)
        spec = row.seq.request.spec
        tokens.extend(row.token_ids)
        starts.append(row.start)
        num_samples.append(row.num_samples)
        temps.append(spec.temperature)
        top_ps.append(spec.top_p)
        top_ks.append(spec.top_k)
        tops.append(row.num_top)
        seeds.extend(s & SEED_MASK for s in row.seeds)
        want_logprobs = want_logprobs or spec.logprobs
        processed = processed or spec.processed
    sampling = executor_pb2.SamplingBatch(
        num_samples=array_bytes(num_samples), temperature=array_bytes(temps), top_p=array_bytes(top_ps),
        top_k=array_bytes(top_ks), seeds=array_bytes(seeds), num_top_logprobs=array_bytes(tops),
        return_logprobs=want_logprobs)
    if processed:  # only batches with penalties, min_p, a logit bias or min_tokens pay for these columns
        _add_processing(sampling, rows)
    return executor_pb2.ExecuteRequest(
        step_id=step_id, incarnation=incarnation, plan=plan, context_lens=array_bytes(starts),
        token_ids=array_bytes(tokens), sampling=sampling,
        prev_step_id=prev_step_id, decode_steps=burst + 1 if burst else 0, cut_prev=cut_prev)


def _add_processing(sampling: executor_pb2.SamplingBatch, rows: list[Row]) -> None:
    """The optional SamplingBatch columns, each only when some row needs it."""
    specs = [row.seq.request.spec for row in rows]
    if any(s.penalized for s in specs):
        sampling.presence_penalty = array_bytes(array("f", (s.presence_penalty for s in specs)))
        sampling.frequency_penalty = array_bytes(array("f", (s.frequency_penalty for s in specs)))
        sampling.repetition_penalty = array_bytes(array("f", (s.repetition_penalty for s in specs)))
        sampling.prompt_lens = array_bytes(array("i", (len(row.seq.request.prompt_ids) for row in rows)))
    if any(s.min_p for s in specs):
        sampling.min_p = array_bytes(array("f", (s.min_p for s in specs)))
    if any(row.bias for row in rows):
        offsets, ids, values = array("i", [0]), array("i"), array("f")
        for row in rows:
            ids.extend(t for t, _ in row.bias)
            values.extend(b for _, b in row.bias)
            offsets.append(len(ids))
        sampling.logit_bias_offsets = array_bytes(offsets)
        sampling.logit_bias_token_ids = array_bytes(ids)
        sampling.logit_bias_values = array_bytes(values)
    if any(row.history for row in rows):
        offsets, ids = array("i", [0]), array("i")
        for row in rows:
            ids.extend(row.history or ())
            offsets.append(len(ids))
        sampling.history_offsets = array_bytes(offsets)
        sampling.history_token_ids = array_bytes(ids)


@dataclass(slots=True)
class RowResult:
    """What one row got back: sampled tokens (with logprobs), or beam candidates."""

    row: Row
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    top: list[tuple[int, float]] | None = None  # a sampling row's alternatives (top_logprobs)


def row_results(rows: Iterable[Row], resp: executor_pb2.ExecuteResponse) -> list[RowResult]:
    """The response cut into rows (rows that sampled nothing and want no top
    logprobs are skipped; a burst cut short returns what its sub-steps ran)."""
    sampled = unpack_i32(resp.sampled_token_ids)
    logprobs = unpack_f32(resp.sampled_logprobs) if resp.sampled_logprobs else None
    top_offsets = unpack_i32(resp.top_offsets) if resp.top_offsets else None
    top_ids = unpack_i32(resp.top_token_ids) if resp.top_token_ids else None
    top_lps = unpack_f32(resp.top_logprobs) if resp.top_logprobs else None
    out = []
    pos = 0
    ran = resp.sub_steps_run  # a burst cut short: each row has at most this many samples
    for i, row in enumerate(rows):
        n = row.num_samples + row.burst
        if ran and n > ran:
            n = ran
        if row.num_top and not n:  # beam search: candidates only
            a, b = top_offsets[i], top_offsets[i + 1]
            out.append(RowResult(row, top_ids=list(top_ids[a:b]), top_logprobs=list(top_lps[a:b])))
            continue
        if not n:
            continue
        toks = list(sampled[pos:pos + n])
        lps = list(logprobs[pos:pos + n]) if logprobs is not None else [None] * n
        pos += n
        top = None
        if row.num_top:
            a, b = top_offsets[i], top_offsets[i + 1]
            top = list(zip(top_ids[a:b], top_lps[a:b]))
        out.append(RowResult(row, toks, lps, top=top))
    return out
