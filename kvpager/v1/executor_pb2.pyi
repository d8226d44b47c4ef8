from kvpager.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingBatch(_message.Message):
    __slots__ = ("num_samples", "temperature", "top_p", "top_k", "seeds", "num_top_logprobs", "return_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias_offsets", "logit_bias_token_ids", "logit_bias_values", "prompt_lens", "history_offsets", "history_token_ids")
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_samples: bytes
    temperature: bytes
    top_p: bytes
    top_k: bytes
    seeds: bytes
    num_top_logprobs: bytes
    return_logprobs: bool
    presence_penalty: bytes
    frequency_penalty: bytes
    repetition_penalty: bytes
    min_p: bytes
    logit_bias_offsets: bytes
    logit_bias_token_ids: bytes
    logit_bias_values: bytes
    prompt_lens: bytes
    history_offsets: bytes
    history_token_ids: bytes
    def __init__(self, num_samples: _Optional[bytes] = ..., temperature: _Optional[bytes] = ..., top_p: _Optional[bytes] = ..., top_k: _Optional[bytes] = ..., seeds: _Optional[bytes] = ..., num_top_logprobs: _Optional[bytes] = ..., return_logprobs: _Optional[bool] = ..., presence_penalty: _Optional[bytes] = ..., frequency_penalty: _Optional[bytes] = ..., repetition_penalty: _Optional[bytes] = ..., min_p: _Optional[bytes] = ..., logit_bias_offsets: _Optional[bytes] = ..., logit_bias_token_ids: _Optional[bytes] = ..., logit_bias_values: _Optional[bytes] = ..., prompt_lens: _Optional[bytes] = ..., history_offsets: _Optional[bytes] = ..., history_token_ids: _Optional[bytes] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("step_id", "incarnation", "plan", "context_lens", "token_ids", "sampling", "prev_step_id", "decode_steps", "cut_prev")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREV_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    CUT_PREV_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    incarnation: int
    plan: _common_pb2.ExecutorPlan
    context_lens: bytes
    token_ids: bytes
    sampling: SamplingBatch
    prev_step_id: int
    decode_steps: int
    cut_prev: bool
    def __init__(self, step_id: _Optional[int] = ..., incarnation: _Optional[int] = ..., plan: _Optional[_Union[_common_pb2.ExecutorPlan, _Mapping]] = ..., context_lens: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingBatch, _Mapping]] = ..., prev_step_id: _Optional[int] = ..., decode_steps: _Optional[int] = ..., cut_prev: _Optional[bool] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "sampled_logprobs", "top_offsets", "top_token_ids", "top_logprobs", "forward_s", "sample_s", "cache_ops_s", "partial", "sub_step", "sub_steps_run", "sub_step_carried")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_OPS_S_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    SUB_STEP_FIELD_NUMBER: _ClassVar[int]
    SUB_STEPS_RUN_FIELD_NUMBER: _ClassVar[int]
    SUB_STEP_CARRIED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: bytes
    sampled_logprobs: bytes
    top_offsets: bytes
    top_token_ids: bytes
    top_logprobs: bytes
    forward_s: float
    sample_s: float
    cache_ops_s: float
    partial: bool
    sub_step: int
    sub_steps_run: int
    sub_step_carried: bool
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[bytes] = ..., sampled_logprobs: _Optional[bytes] = ..., top_offsets: _Optional[bytes] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., forward_s: _Optional[float] = ..., sample_s: _Optional[float] = ..., cache_ops_s: _Optional[float] = ..., partial: _Optional[bool] = ..., sub_step: _Optional[int] = ..., sub_steps_run: _Optional[int] = ..., sub_step_carried: _Optional[bool] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorInfo(_message.Message):
    __slots__ = ("executor_id", "model_id", "model_type", "vocab_size", "max_model_len", "eos_token_ids", "num_layers", "num_kv_heads", "head_dim", "dtype", "device", "attention_backend", "num_blocks", "block_size", "num_swap_blocks", "incarnation", "pool_generation", "kv_pool_bytes", "model_impl", "kv_layout", "kv_groups")
    EXECUTOR_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_IMPL_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    executor_id: str
    model_id: str
    model_type: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    attention_backend: str
    num_blocks: int
    block_size: int
    num_swap_blocks: int
    incarnation: int
    pool_generation: int
    kv_pool_bytes: int
    model_impl: str
    kv_layout: str
    kv_groups: _containers.RepeatedCompositeFieldContainer[KvGroupInfo]
    def __init__(self, executor_id: _Optional[str] = ..., model_id: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_swap_blocks: _Optional[int] = ..., incarnation: _Optional[int] = ..., pool_generation: _Optional[int] = ..., kv_pool_bytes: _Optional[int] = ..., model_impl: _Optional[str] = ..., kv_layout: _Optional[str] = ..., kv_groups: _Optional[_Iterable[_Union[KvGroupInfo, _Mapping]]] = ...) -> None: ...

class KvGroupInfo(_message.Message):
    __slots__ = ("window", "layers")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class ConfirmPoolRequest(_message.Message):
    __slots__ = ("incarnation", "pool_generation", "written_since_step")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    pool_generation: int
    written_since_step: int
    def __init__(self, incarnation: _Optional[int] = ..., pool_generation: _Optional[int] = ..., written_since_step: _Optional[int] = ...) -> None: ...

class ConfirmPoolResponse(_message.Message):
    __slots__ = ("confirmed", "incarnation", "pool_generation", "last_step_id", "writes_known", "written_block_ids")
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POOL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    WRITES_KNOWN_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    confirmed: bool
    incarnation: int
    pool_generation: int
    last_step_id: int
    writes_known: bool
    written_block_ids: bytes
    def __init__(self, confirmed: _Optional[bool] = ..., incarnation: _Optional[int] = ..., pool_generation: _Optional[int] = ..., last_step_id: _Optional[int] = ..., writes_known: _Optional[bool] = ..., written_block_ids: _Optional[bytes] = ...) -> None: ...
