from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class PreemptionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPTION_MODE_UNSPECIFIED: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_RECOMPUTE: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_SWAP: _ClassVar[PreemptionMode]

class RejectionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECTION_REASON_UNSPECIFIED: _ClassVar[RejectionReason]
    REJECTION_REASON_OVER_CONTEXT_LIMIT: _ClassVar[RejectionReason]
    REJECTION_REASON_OVER_POOL: _ClassVar[RejectionReason]
    REJECTION_REASON_OVER_QUOTA: _ClassVar[RejectionReason]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_CPU: _ClassVar[Tier]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
PREEMPTION_MODE_UNSPECIFIED: PreemptionMode
PREEMPTION_MODE_RECOMPUTE: PreemptionMode
PREEMPTION_MODE_SWAP: PreemptionMode
REJECTION_REASON_UNSPECIFIED: RejectionReason
REJECTION_REASON_OVER_CONTEXT_LIMIT: RejectionReason
REJECTION_REASON_OVER_POOL: RejectionReason
REJECTION_REASON_OVER_QUOTA: RejectionReason
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_CPU: Tier

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids", "ignore_eos", "beam_width", "length_penalty", "min_tokens", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    beam_width: int
    length_penalty: float
    min_tokens: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class CacheOps(_message.Message):
    __slots__ = ("copy_src", "copy_dst", "swap_out_src", "swap_out_dst", "swap_in_src", "swap_in_dst")
    COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_SRC_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_DST_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_SRC_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_DST_FIELD_NUMBER: _ClassVar[int]
    copy_src: bytes
    copy_dst: bytes
    swap_out_src: bytes
    swap_out_dst: bytes
    swap_in_src: bytes
    swap_in_dst: bytes
    def __init__(self, copy_src: _Optional[bytes] = ..., copy_dst: _Optional[bytes] = ..., swap_out_src: _Optional[bytes] = ..., swap_out_dst: _Optional[bytes] = ..., swap_in_src: _Optional[bytes] = ..., swap_in_dst: _Optional[bytes] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("seq_ids", "offsets", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: bytes
    offsets: bytes
    token_ids: bytes
    def __init__(self, seq_ids: _Optional[bytes] = ..., offsets: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class ForkOp(_message.Message):
    __slots__ = ("parent_seq_id", "child_seq_ids")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, parent_seq_id: _Optional[int] = ..., child_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TableChanges(_message.Message):
    __slots__ = ("forks", "dropped_seq_ids", "started_seq_ids", "started_context_lens", "started_offsets", "started_block_ids", "extended_seq_ids", "extended_first_index", "extended_offsets", "extended_block_ids")
    FORKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    STARTED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STARTED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTENDED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    EXTENDED_FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXTENDED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    EXTENDED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    forks: _containers.RepeatedCompositeFieldContainer[ForkOp]
    dropped_seq_ids: bytes
    started_seq_ids: bytes
    started_context_lens: bytes
    started_offsets: bytes
    started_block_ids: bytes
    extended_seq_ids: bytes
    extended_first_index: bytes
    extended_offsets: bytes
    extended_block_ids: bytes
    def __init__(self, forks: _Optional[_Iterable[_Union[ForkOp, _Mapping]]] = ..., dropped_seq_ids: _Optional[bytes] = ..., started_seq_ids: _Optional[bytes] = ..., started_context_lens: _Optional[bytes] = ..., started_offsets: _Optional[bytes] = ..., started_block_ids: _Optional[bytes] = ..., extended_seq_ids: _Optional[bytes] = ..., extended_first_index: _Optional[bytes] = ..., extended_offsets: _Optional[bytes] = ..., extended_block_ids: _Optional[bytes] = ...) -> None: ...

class ExecutorPlan(_message.Message):
    __slots__ = ("executor_id", "incarnation", "table_epoch", "seq_ids", "query_lens", "tables", "cache_ops", "started_cached_tokens", "group_tables")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    QUERY_LENS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CACHE_OPS_FIELD_NUMBER: _ClassVar[int]
    STARTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_TABLES_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    incarnation: int
    table_epoch: int
    seq_ids: bytes
    query_lens: bytes
    tables: TableChanges
    cache_ops: CacheOps
    started_cached_tokens: bytes
    group_tables: _containers.RepeatedCompositeFieldContainer[TableChanges]
    def __init__(self, executor_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., table_epoch: _Optional[int] = ..., seq_ids: _Optional[bytes] = ..., query_lens: _Optional[bytes] = ..., tables: _Optional[_Union[TableChanges, _Mapping]] = ..., cache_ops: _Optional[_Union[CacheOps, _Mapping]] = ..., started_cached_tokens: _Optional[bytes] = ..., group_tables: _Optional[_Iterable[_Union[TableChanges, _Mapping]]] = ...) -> None: ...
