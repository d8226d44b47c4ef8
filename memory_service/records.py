"""Typed records at the memory service's boundary (servicer <-> manager).

Packed arrays from the wire arrive as `array` objects (int64 'q' for ids,
int32 'i' for counts and tokens) and leave the same way.
"""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field

from memory_service.changes import CacheOpsBuilder, TableChanges
from memory_service.policy import PreemptionDecision, PreemptionMode


@dataclass(slots=True)
class NewSeq:
    seq_id: int
    executor_id: str
    prompt_token_ids: array | list[int]
    priority: int = 0
    cache_salt: str = ""
    max_total_tokens: int = 0
    # the prompt's leading full-block hashes as the router computed them (None: hash here)
    prompt_block_hashes: list[bytes] | None = None
    request_id: str = ""            # the client's, for operators (logs, the block map)
    tenant: str = ""                # whose blocks these are (per-tenant quotas)
    retention_s: float = 0.0        # pin its prompt's blocks this long after it ends (memory_service.retention)


@dataclass(slots=True)
class StepInput:
    step_id: int = 0
    # tokens sampled last step, CSR: appended_seq_ids[i] gets
    # appended_tokens[appended_offsets[i]:appended_offsets[i + 1]]
    appended_seq_ids: array | list[int] = field(default_factory=list)
    appended_offsets: array | list[int] = field(default_factory=list)
    appended_tokens: array | list[int] = field(default_factory=list)
    forks: list[tuple[int, list[int]]] = field(default_factory=list)
    free_seq_ids: array | list[int] = field(default_factory=list)
    abort_seq_ids: array | list[int] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    schedule_seq_ids: array | list[int] = field(default_factory=list)
    schedule_num_tokens: array | list[int] = field(default_factory=list)
    # Sequences whose next token an Execute in flight is sampling: each gets a
    # placeholder token now (so it can be scheduled before the id is known);
    # a later step's appended replaces it.
    pending_seq_ids: array | list[int] = field(default_factory=list)
    # Per scheduled sequence (empty: all 0): tokens a RUNNING one samples
    # ahead in this step (a decode burst): granted, they join it as
    # placeholders computed now, which later appends replace.
    schedule_lookahead: array | list[int] = field(default_factory=list)
    # RUNNING sequences whose decode burst an executor cut short: the
    # placeholders left go, only their tokens but the last stay computed.
    cut_seq_ids: array | list[int] = field(default_factory=list)
    # Cut short too, with the next sub-step carried into the step that cut it:
    # all their tokens stay computed (the sample of the last comes later).
    carried_seq_ids: array | list[int] = field(default_factory=list)


@dataclass(slots=True)
class ExecutorStepPlan:
    """One executor's part of a step: its rows, what changed in its block
    tables since its last plan, and the block moves before the forward."""

    executor_id: str
    incarnation: int
    table_epoch: int
    seq_ids: array = field(default_factory=lambda: array("q"))     # the rows, in allocation order
    query_lens: array = field(default_factory=lambda: array("i"))  # tokens each computes now
    tables: TableChanges = field(default_factory=TableChanges)
    group_tables: list[TableChanges] = field(default_factory=list)  # KV groups 1, 2, … (grouped executors)
    ops: CacheOpsBuilder = field(default_factory=CacheOpsBuilder)


class RejectionReason(enum.Enum):
    """Why a new sequence can never be taken (its request fails with the status the gateway maps it to)."""

    OVER_CONTEXT_LIMIT = "over_context_limit"   # longer than the executor's context limit
    OVER_POOL = "over_pool"                     # needs more blocks than the whole pool holds
    OVER_QUOTA = "over_quota"                   # needs more blocks than its tenant may hold


@dataclass(slots=True)
class Rejected:
    seq_id: int
    reason: RejectionReason
    message: str


@dataclass(slots=True)
class StepOutput:
    step_id: int
    executor_plans: list[ExecutorStepPlan] = field(default_factory=list)
    preempted: list[tuple[int, PreemptionMode]] = field(default_factory=list)
    decisions: list[PreemptionDecision] = field(default_factory=list)  # beside preempted: why, at what cost
    unscheduled: list[int] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


@dataclass(slots=True)
class PrefixScore:
    executor_id: str
    hit_blocks: int
    hit_tokens: int
    num_sequences: int
    free_blocks: int
    block_size: int
