from kvpager.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutorPoolInfo(_message.Message):
    __slots__ = ("executor_id", "address", "num_blocks", "block_size", "num_swap_blocks", "model_id", "dtype", "incarnation", "pool_generation", "max_model_len", "vocab_size", "adapter", "costs", "kv_group_windows")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    address: str
    num_blocks: int
    block_size: int
    num_swap_blocks: int
    model_id: str
    dtype: str
    incarnation: int
    pool_generation: int
    max_model_len: int
    vocab_size: int
    adapter: str
    costs: ExecutorCosts
    kv_group_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, executor_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., incarnation: _Optional[int] = ..., pool_generation: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., adapter: _Optional[str] = ..., costs: _Optional[_Union[ExecutorCosts, _Mapping]] = ..., kv_group_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecutorCosts(_message.Message):
    __slots__ = ("prefill_batch_tokens", "prefill_tokens_per_s", "swap_bytes_per_s", "block_bytes")
    PREFILL_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    prefill_batch_tokens: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens_per_s: _containers.RepeatedScalarFieldContainer[float]
    swap_bytes_per_s: float
    block_bytes: int
    def __init__(self, prefill_batch_tokens: _Optional[_Iterable[int]] = ..., prefill_tokens_per_s: _Optional[_Iterable[float]] = ..., swap_bytes_per_s: _Optional[float] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class RegisterExecutorRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: ExecutorPoolInfo
    def __init__(self, info: _Optional[_Union[ExecutorPoolInfo, _Mapping]] = ...) -> None: ...

class RegisterExecutorResponse(_message.Message):
    __slots__ = ("replaced_previous", "lease_s")
    REPLACED_PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    replaced_previous: bool
    lease_s: float
    def __init__(self, replaced_previous: _Optional[bool] = ..., lease_s: _Optional[float] = ...) -> None: ...

class DeregisterExecutorRequest(_message.Message):
    __slots__ = ("executor_id", "incarnation")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    incarnation: int
    def __init__(self, executor_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class DeregisterExecutorResponse(_message.Message):
    __slots__ = ("sequences_dropped",)
    SEQUENCES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    sequences_dropped: int
    def __init__(self, sequences_dropped: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("executor_id", "incarnation", "costs")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    incarnation: int
    costs: ExecutorCosts
    def __init__(self, executor_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., costs: _Optional[_Union[ExecutorCosts, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class ListExecutorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListExecutorsResponse(_message.Message):
    __slots__ = ("executors", "last_step_id")
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    executors: _containers.RepeatedCompositeFieldContainer[ExecutorPoolInfo]
    last_step_id: int
    def __init__(self, executors: _Optional[_Iterable[_Union[ExecutorPoolInfo, _Mapping]]] = ..., last_step_id: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "executor_id", "prompt_token_ids", "priority", "cache_salt", "max_total_tokens", "prompt_block_hashes", "request_id", "tenant", "retention_s")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RETENTION_S_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    executor_id: str
    prompt_token_ids: bytes
    priority: int
    cache_salt: str
    max_total_tokens: int
    prompt_block_hashes: bytes
    request_id: str
    tenant: str
    retention_s: float
    def __init__(self, seq_id: _Optional[int] = ..., executor_id: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., max_total_tokens: _Optional[int] = ..., prompt_block_hashes: _Optional[bytes] = ..., request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., retention_s: _Optional[float] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "appended", "forks", "free_seq_ids", "abort_seq_ids", "new_sequences", "schedule_seq_ids", "schedule_num_tokens", "pending_seq_ids", "schedule_lookahead", "cut_seq_ids", "carried_seq_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    FREE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PENDING_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    CUT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CARRIED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    appended: _common_pb2.TokenBatch
    forks: _containers.RepeatedCompositeFieldContainer[_common_pb2.ForkOp]
    free_seq_ids: bytes
    abort_seq_ids: bytes
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    schedule_seq_ids: bytes
    schedule_num_tokens: bytes
    pending_seq_ids: bytes
    schedule_lookahead: bytes
    cut_seq_ids: bytes
    carried_seq_ids: bytes
    def __init__(self, step_id: _Optional[int] = ..., appended: _Optional[_Union[_common_pb2.TokenBatch, _Mapping]] = ..., forks: _Optional[_Iterable[_Union[_common_pb2.ForkOp, _Mapping]]] = ..., free_seq_ids: _Optional[bytes] = ..., abort_seq_ids: _Optional[bytes] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., schedule_seq_ids: _Optional[bytes] = ..., schedule_num_tokens: _Optional[bytes] = ..., pending_seq_ids: _Optional[bytes] = ..., schedule_lookahead: _Optional[bytes] = ..., cut_seq_ids: _Optional[bytes] = ..., carried_seq_ids: _Optional[bytes] = ...) -> None: ...

class Preemption(_message.Message):
    __slots__ = ("seq_id", "mode", "reason", "recompute_tokens", "recompute_cost_s", "swap_bytes", "swap_cost_s")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_COST_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_COST_S_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    mode: _common_pb2.PreemptionMode
    reason: str
    recompute_tokens: int
    recompute_cost_s: float
    swap_bytes: int
    swap_cost_s: float
    def __init__(self, seq_id: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.PreemptionMode, str]] = ..., reason: _Optional[str] = ..., recompute_tokens: _Optional[int] = ..., recompute_cost_s: _Optional[float] = ..., swap_bytes: _Optional[int] = ..., swap_cost_s: _Optional[float] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("seq_id", "reason", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    reason: _common_pb2.RejectionReason
    message: str
    def __init__(self, seq_id: _Optional[int] = ..., reason: _Optional[_Union[_common_pb2.RejectionReason, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "executor_plans", "preempted", "unscheduled_seq_ids", "rejected")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_PLANS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    UNSCHEDULED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    executor_plans: _containers.RepeatedCompositeFieldContainer[_common_pb2.ExecutorPlan]
    preempted: _containers.RepeatedCompositeFieldContainer[Preemption]
    unscheduled_seq_ids: bytes
    rejected: _containers.RepeatedCompositeFieldContainer[Rejection]
    def __init__(self, step_id: _Optional[int] = ..., executor_plans: _Optional[_Iterable[_Union[_common_pb2.ExecutorPlan, _Mapping]]] = ..., preempted: _Optional[_Iterable[_Union[Preemption, _Mapping]]] = ..., unscheduled_seq_ids: _Optional[bytes] = ..., rejected: _Optional[_Iterable[_Union[Rejection, _Mapping]]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("fork",)
    FORK_FIELD_NUMBER: _ClassVar[int]
    fork: _common_pb2.ForkOp
    def __init__(self, fork: _Optional[_Union[_common_pb2.ForkOp, _Mapping]] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("shared_blocks",)
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    shared_blocks: int
    def __init__(self, shared_blocks: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids", "abort")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    abort: bool
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., abort: _Optional[bool] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("blocks_released",)
    BLOCKS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    blocks_released: int
    def __init__(self, blocks_released: _Optional[int] = ...) -> None: ...

class PoolAccounting(_message.Message):
    __slots__ = ("executor_id", "total_blocks", "free_blocks", "used_blocks", "cached_blocks", "live_tokens", "allocated_slots", "kv_utilization", "logical_blocks", "physical_blocks", "sharing_saved_blocks", "prefix_hit_rate", "prefix_query_tokens", "prefix_hit_tokens", "preemptions", "preemptions_recompute", "preemptions_swap", "contiguous_equivalent_blocks", "num_sequences", "num_swapped_sequences", "swap_total_blocks", "swap_free_blocks", "copy_on_write_copies", "evictions", "block_size", "swapped_out_blocks", "swapped_in_blocks", "block_usage", "token_occupancy", "recompute_query_tokens", "recompute_hit_tokens", "recompute_hit_rate", "contiguous_declared_blocks", "preempt_recompute_tokens", "preempt_swap_bytes", "preempt_cost_s", "preempt_saved_s", "prefill_tokens_per_s", "swap_bytes_per_s", "pinned_blocks", "kv_groups")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHARING_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    CONTIGUOUS_EQUIVALENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SWAP_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPY_ON_WRITE_COPIES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_USAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CONTIGUOUS_DECLARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_RECOMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_COST_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPT_SAVED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    live_tokens: int
    allocated_slots: int
    kv_utilization: float
    logical_blocks: int
    physical_blocks: int
    sharing_saved_blocks: int
    prefix_hit_rate: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    preemptions_recompute: int
    preemptions_swap: int
    contiguous_equivalent_blocks: int
    num_sequences: int
    num_swapped_sequences: int
    swap_total_blocks: int
    swap_free_blocks: int
    copy_on_write_copies: int
    evictions: int
    block_size: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    block_usage: float
    token_occupancy: float
    recompute_query_tokens: int
    recompute_hit_tokens: int
    recompute_hit_rate: float
    contiguous_declared_blocks: int
    preempt_recompute_tokens: int
    preempt_swap_bytes: int
    preempt_cost_s: float
    preempt_saved_s: float
    prefill_tokens_per_s: float
    swap_bytes_per_s: float
    pinned_blocks: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KvGroupAccounting]
    def __init__(self, executor_id: _Optional[str] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., live_tokens: _Optional[int] = ..., allocated_slots: _Optional[int] = ..., kv_utilization: _Optional[float] = ..., logical_blocks: _Optional[int] = ..., physical_blocks: _Optional[int] = ..., sharing_saved_blocks: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., preemptions_recompute: _Optional[int] = ..., preemptions_swap: _Optional[int] = ..., contiguous_equivalent_blocks: _Optional[int] = ..., num_sequences: _Optional[int] = ..., num_swapped_sequences: _Optional[int] = ..., swap_total_blocks: _Optional[int] = ..., swap_free_blocks: _Optional[int] = ..., copy_on_write_copies: _Optional[int] = ..., evictions: _Optional[int] = ..., block_size: _Optional[int] = ..., swapped_out_blocks: _Optional[int] = ..., swapped_in_blocks: _Optional[int] = ..., block_usage: _Optional[float] = ..., token_occupancy: _Optional[float] = ..., recompute_query_tokens: _Optional[int] = ..., recompute_hit_tokens: _Optional[int] = ..., recompute_hit_rate: _Optional[float] = ..., contiguous_declared_blocks: _Optional[int] = ..., preempt_recompute_tokens: _Optional[int] = ..., preempt_swap_bytes: _Optional[int] = ..., preempt_cost_s: _Optional[float] = ..., preempt_saved_s: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., swap_bytes_per_s: _Optional[float] = ..., pinned_blocks: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KvGroupAccounting, _Mapping]]] = ...) -> None: ...

class KvGroupAccounting(_message.Message):
    __slots__ = ("window", "used_blocks", "logical_blocks", "full_attention_blocks", "window_saved_blocks", "max_seq_blocks")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FULL_ATTENTION_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SAVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    window: int
    used_blocks: int
    logical_blocks: int
    full_attention_blocks: int
    window_saved_blocks: int
    max_seq_blocks: int
    def __init__(self, window: _Optional[int] = ..., used_blocks: _Optional[int] = ..., logical_blocks: _Optional[int] = ..., full_attention_blocks: _Optional[int] = ..., window_saved_blocks: _Optional[int] = ..., max_seq_blocks: _Optional[int] = ...) -> None: ...

class AccountingRequest(_message.Message):
    __slots__ = ("executor_id",)
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    def __init__(self, executor_id: _Optional[str] = ...) -> None: ...

class WatchAccountingRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class AccountingSnapshot(_message.Message):
    __slots__ = ("time_s", "total", "executors", "mirror_enabled", "mirror_stale", "mirror_lag_events", "step_id")
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_ENABLED_FIELD_NUMBER: _ClassVar[int]
    MIRROR_STALE_FIELD_NUMBER: _ClassVar[int]
    MIRROR_LAG_EVENTS_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    time_s: float
    total: PoolAccounting
    executors: _containers.RepeatedCompositeFieldContainer[PoolAccounting]
    mirror_enabled: bool
    mirror_stale: bool
    mirror_lag_events: int
    step_id: int
    def __init__(self, time_s: _Optional[float] = ..., total: _Optional[_Union[PoolAccounting, _Mapping]] = ..., executors: _Optional[_Iterable[_Union[PoolAccounting, _Mapping]]] = ..., mirror_enabled: _Optional[bool] = ..., mirror_stale: _Optional[bool] = ..., mirror_lag_events: _Optional[int] = ..., step_id: _Optional[int] = ...) -> None: ...

class ScorePrefixRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt", "executor_ids", "block_hashes", "namespace")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    cache_salt: str
    executor_ids: _containers.RepeatedScalarFieldContainer[str]
    block_hashes: bytes
    namespace: bytes
    def __init__(self, token_ids: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., executor_ids: _Optional[_Iterable[str]] = ..., block_hashes: _Optional[bytes] = ..., namespace: _Optional[bytes] = ...) -> None: ...

class ExecutorScore(_message.Message):
    __slots__ = ("executor_id", "hit_blocks", "hit_tokens", "num_sequences", "free_blocks", "block_size")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    hit_blocks: int
    hit_tokens: int
    num_sequences: int
    free_blocks: int
    block_size: int
    def __init__(self, executor_id: _Optional[str] = ..., hit_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_sequences: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class ScorePrefixResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ExecutorScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[ExecutorScore, _Mapping]]] = ...) -> None: ...
