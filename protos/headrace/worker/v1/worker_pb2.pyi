from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "path")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    adapter_id: int
    path: str
    def __init__(self, adapter_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("rank", "fingerprint", "bytes", "seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fingerprint: int
    bytes: int
    seconds: float
    def __init__(self, rank: _Optional[int] = ..., fingerprint: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DropAdaptersRequest(_message.Message):
    __slots__ = ("adapter_ids", "below_id")
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    BELOW_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[int]
    below_id: int
    def __init__(self, adapter_ids: _Optional[_Iterable[int]] = ..., below_id: _Optional[int] = ...) -> None: ...

class DropAdaptersResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "max_model_len", "dtype", "device", "rank", "world_size", "block_size", "num_kv_blocks", "kv_bytes_per_block", "eos_token_ids", "max_num_seqs", "max_batched_tokens", "startup_seconds", "kv_cache_dtype", "quantization", "speculative", "num_host_kv_blocks", "host_kv_load_bytes_per_s", "prefill_profile_tokens", "prefill_profile_seconds", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_slot_bytes", "deterministic")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STARTUP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_LOAD_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PROFILE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PROFILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    rank: int
    world_size: int
    block_size: int
    num_kv_blocks: int
    kv_bytes_per_block: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_num_seqs: int
    max_batched_tokens: int
    startup_seconds: float
    kv_cache_dtype: str
    quantization: str
    speculative: Speculative
    num_host_kv_blocks: int
    host_kv_load_bytes_per_s: float
    prefill_profile_tokens: _containers.RepeatedScalarFieldContainer[int]
    prefill_profile_seconds: _containers.RepeatedScalarFieldContainer[float]
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_slot_bytes: int
    deterministic: bool
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_bytes_per_block: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_num_seqs: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., startup_seconds: _Optional[float] = ..., kv_cache_dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., speculative: _Optional[_Union[Speculative, _Mapping]] = ..., num_host_kv_blocks: _Optional[int] = ..., host_kv_load_bytes_per_s: _Optional[float] = ..., prefill_profile_tokens: _Optional[_Iterable[int]] = ..., prefill_profile_seconds: _Optional[_Iterable[float]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., lora_slot_bytes: _Optional[int] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class Speculative(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "disable_by_batch_size", "min_acceptance")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DISABLE_BY_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    model: str
    disable_by_batch_size: int
    min_acceptance: float
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., model: _Optional[str] = ..., disable_by_batch_size: _Optional[int] = ..., min_acceptance: _Optional[float] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "has_seed", "seed", "logprobs", "min_tokens", "stop_token_ids", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    has_seed: bool
    seed: int
    logprobs: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "prompt_token_ids", "output_token_ids", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling", "lora_slot")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: Sampling
    lora_slot: int
    def __init__(self, seq_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., lora_slot: _Optional[int] = ...) -> None: ...

class LoraLoad(_message.Message):
    __slots__ = ("slot", "adapter_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    slot: int
    adapter_id: int
    def __init__(self, slot: _Optional[int] = ..., adapter_id: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "new_seqs", "running_seq_ids", "running_num_scheduled", "running_new_block_counts", "running_new_block_ids", "finished_seq_ids", "copy_src_blocks", "copy_dst_blocks", "flush", "running_num_spec", "truncate_seq_ids", "truncate_num_blocks", "swap_out_device_blocks", "swap_out_host_blocks", "swap_in_host_blocks", "swap_in_device_blocks", "trace_context", "trace_links", "bitmask", "bitmask_follows", "late_bitmask", "checked_draft_seq_ids", "checked_draft_counts", "checked_drafts", "profile", "lora_loads", "lora_drops")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_NUM_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_NUM_SPEC_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TRACE_LINKS_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FIELD_NUMBER: _ClassVar[int]
    BITMASK_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    LATE_BITMASK_FIELD_NUMBER: _ClassVar[int]
    CHECKED_DRAFT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_DROPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    running_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    running_num_scheduled: _containers.RepeatedScalarFieldContainer[int]
    running_new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    running_new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    copy_src_blocks: _containers.RepeatedScalarFieldContainer[int]
    copy_dst_blocks: _containers.RepeatedScalarFieldContainer[int]
    flush: bool
    running_num_spec: _containers.RepeatedScalarFieldContainer[int]
    truncate_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    truncate_num_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_out_device_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_out_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_device_blocks: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    trace_links: _containers.RepeatedScalarFieldContainer[str]
    bitmask: TokenBitmask
    bitmask_follows: bool
    late_bitmask: bool
    checked_draft_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    checked_draft_counts: _containers.RepeatedScalarFieldContainer[int]
    checked_drafts: _containers.RepeatedScalarFieldContainer[int]
    profile: ProfileCommand
    lora_loads: _containers.RepeatedCompositeFieldContainer[LoraLoad]
    lora_drops: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., running_seq_ids: _Optional[_Iterable[int]] = ..., running_num_scheduled: _Optional[_Iterable[int]] = ..., running_new_block_counts: _Optional[_Iterable[int]] = ..., running_new_block_ids: _Optional[_Iterable[int]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., copy_src_blocks: _Optional[_Iterable[int]] = ..., copy_dst_blocks: _Optional[_Iterable[int]] = ..., flush: _Optional[bool] = ..., running_num_spec: _Optional[_Iterable[int]] = ..., truncate_seq_ids: _Optional[_Iterable[int]] = ..., truncate_num_blocks: _Optional[_Iterable[int]] = ..., swap_out_device_blocks: _Optional[_Iterable[int]] = ..., swap_out_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_device_blocks: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., trace_links: _Optional[_Iterable[str]] = ..., bitmask: _Optional[_Union[TokenBitmask, _Mapping]] = ..., bitmask_follows: _Optional[bool] = ..., late_bitmask: _Optional[bool] = ..., checked_draft_seq_ids: _Optional[_Iterable[int]] = ..., checked_draft_counts: _Optional[_Iterable[int]] = ..., checked_drafts: _Optional[_Iterable[int]] = ..., profile: _Optional[_Union[ProfileCommand, _Mapping]] = ..., lora_loads: _Optional[_Iterable[_Union[LoraLoad, _Mapping]]] = ..., lora_drops: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenBitmask(_message.Message):
    __slots__ = ("seq_ids", "bits", "mask_of", "allowed_counts", "allowed_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    MASK_OF_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    bits: bytes
    mask_of: _containers.RepeatedScalarFieldContainer[int]
    allowed_counts: _containers.RepeatedScalarFieldContainer[int]
    allowed_ids: bytes
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., bits: _Optional[bytes] = ..., mask_of: _Optional[_Iterable[int]] = ..., allowed_counts: _Optional[_Iterable[int]] = ..., allowed_ids: _Optional[bytes] = ...) -> None: ...

class ProfileCommand(_message.Message):
    __slots__ = ("dir", "num_steps", "name", "stop")
    DIR_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    dir: str
    num_steps: int
    name: str
    stop: bool
    def __init__(self, dir: _Optional[str] = ..., num_steps: _Optional[int] = ..., name: _Optional[str] = ..., stop: _Optional[bool] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "error_class", "message")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    error_class: str
    message: str
    def __init__(self, step_id: _Optional[int] = ..., error_class: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ProfileReport(_message.Message):
    __slots__ = ("rank", "files", "steps", "error")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    files: _containers.RepeatedScalarFieldContainer[str]
    steps: int
    error: str
    def __init__(self, rank: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., steps: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "token_ids", "logprobs", "top_token_ids", "top_logprobs", "execute_ms", "device_ms", "device_idle_ms", "sample_ms", "stopped_seq_ids", "num_tokens", "num_draft_tokens", "swap_ms", "swap_out_bytes", "swap_in_bytes", "error", "profile_reports")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWAP_MS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROFILE_REPORTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    execute_ms: float
    device_ms: float
    device_idle_ms: float
    sample_ms: float
    stopped_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    swap_ms: float
    swap_out_bytes: int
    swap_in_bytes: int
    error: StepError
    profile_reports: _containers.RepeatedCompositeFieldContainer[ProfileReport]
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., execute_ms: _Optional[float] = ..., device_ms: _Optional[float] = ..., device_idle_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., stopped_seq_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., swap_ms: _Optional[float] = ..., swap_out_bytes: _Optional[int] = ..., swap_in_bytes: _Optional[int] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., profile_reports: _Optional[_Iterable[_Union[ProfileReport, _Mapping]]] = ...) -> None: ...
