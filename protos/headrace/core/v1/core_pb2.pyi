from headrace.worker.v1 import worker_pb2 as _worker_pb2
from headrace.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("frontend_index", "pid", "placement")
    FRONTEND_INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    frontend_index: int
    pid: int
    placement: bool
    def __init__(self, frontend_index: _Optional[int] = ..., pid: _Optional[int] = ..., placement: _Optional[bool] = ...) -> None: ...

class Resumed(_message.Message):
    __slots__ = ("index", "output_token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Submit(_message.Message):
    __slots__ = ("handle", "request_id", "prompt_token_ids", "sampling", "max_tokens", "priority", "stream_interval", "has_stop_strings", "trace_context", "trace_id", "tenant", "age", "structured", "resumed", "lora_name")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    HAS_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    handle: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _containers.RepeatedCompositeFieldContainer[_worker_pb2.Sampling]
    max_tokens: int
    priority: int
    stream_interval: int
    has_stop_strings: bool
    trace_context: _containers.ScalarMap[str, str]
    trace_id: str
    tenant: str
    age: float
    structured: _inference_pb2.StructuredOutputs
    resumed: _containers.RepeatedCompositeFieldContainer[Resumed]
    lora_name: str
    def __init__(self, handle: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Iterable[_Union[_worker_pb2.Sampling, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., stream_interval: _Optional[int] = ..., has_stop_strings: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., trace_id: _Optional[str] = ..., tenant: _Optional[str] = ..., age: _Optional[float] = ..., structured: _Optional[_Union[_inference_pb2.StructuredOutputs, _Mapping]] = ..., resumed: _Optional[_Iterable[_Union[Resumed, _Mapping]]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("handle", "reason", "index")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    handle: int
    reason: _inference_pb2.FinishReason
    index: int
    def __init__(self, handle: _Optional[int] = ..., reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., index: _Optional[int] = ...) -> None: ...

class Up(_message.Message):
    __slots__ = ("hello", "submits", "aborts")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    submits: _containers.RepeatedCompositeFieldContainer[Submit]
    aborts: _containers.RepeatedCompositeFieldContainer[Abort]
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., submits: _Optional[_Iterable[_Union[Submit, _Mapping]]] = ..., aborts: _Optional[_Iterable[_Union[Abort, _Mapping]]] = ...) -> None: ...

class SeqDelta(_message.Message):
    __slots__ = ("handle", "index", "token_ids", "logprobs", "finish_reason", "cached_prompt_tokens")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handle: int
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    finish_reason: _inference_pb2.FinishReason
    cached_prompt_tokens: int
    def __init__(self, handle: _Optional[int] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Failed(_message.Message):
    __slots__ = ("handle", "code", "message")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    code: int
    message: str
    def __init__(self, handle: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CoreState(_message.Message):
    __slots__ = ("healthy", "draining", "loaded", "model_dir", "max_model_len", "info", "model_info", "max_queued", "default_stream_interval", "lora_adapters", "unhealthy_reason")
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    healthy: bool
    draining: bool
    loaded: bool
    model_dir: str
    max_model_len: int
    info: _worker_pb2.WorkerInfo
    model_info: _inference_pb2.ModelInfo
    max_queued: int
    default_stream_interval: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_inference_pb2.LoraAdapter]
    unhealthy_reason: str
    def __init__(self, healthy: _Optional[bool] = ..., draining: _Optional[bool] = ..., loaded: _Optional[bool] = ..., model_dir: _Optional[str] = ..., max_model_len: _Optional[int] = ..., info: _Optional[_Union[_worker_pb2.WorkerInfo, _Mapping]] = ..., model_info: _Optional[_Union[_inference_pb2.ModelInfo, _Mapping]] = ..., max_queued: _Optional[int] = ..., default_stream_interval: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[_inference_pb2.LoraAdapter, _Mapping]]] = ..., unhealthy_reason: _Optional[str] = ...) -> None: ...

class CoreLoad(_message.Message):
    __slots__ = ("running", "waiting", "num_kv_blocks", "num_free_kv_blocks", "block_size", "cache_reset", "cached_hashes", "evicted_hashes", "lora_in_slots", "lora_cached")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_RESET_FIELD_NUMBER: _ClassVar[int]
    CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_HASHES_FIELD_NUMBER: _ClassVar[int]
    LORA_IN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_CACHED_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    block_size: int
    cache_reset: bool
    cached_hashes: _containers.RepeatedScalarFieldContainer[int]
    evicted_hashes: _containers.RepeatedScalarFieldContainer[int]
    lora_in_slots: _containers.RepeatedScalarFieldContainer[str]
    lora_cached: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., cache_reset: _Optional[bool] = ..., cached_hashes: _Optional[_Iterable[int]] = ..., evicted_hashes: _Optional[_Iterable[int]] = ..., lora_in_slots: _Optional[_Iterable[str]] = ..., lora_cached: _Optional[_Iterable[str]] = ...) -> None: ...

class Down(_message.Message):
    __slots__ = ("deltas", "failed", "state", "num_waiting", "token_handles", "token_indexes", "token_counts", "token_ids", "load")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HANDLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDEXES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[SeqDelta]
    failed: _containers.RepeatedCompositeFieldContainer[Failed]
    state: CoreState
    num_waiting: int
    token_handles: _containers.RepeatedScalarFieldContainer[int]
    token_indexes: _containers.RepeatedScalarFieldContainer[int]
    token_counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    load: CoreLoad
    def __init__(self, deltas: _Optional[_Iterable[_Union[SeqDelta, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[Failed, _Mapping]]] = ..., state: _Optional[_Union[CoreState, _Mapping]] = ..., num_waiting: _Optional[int] = ..., token_handles: _Optional[_Iterable[int]] = ..., token_indexes: _Optional[_Iterable[int]] = ..., token_counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., load: _Optional[_Union[CoreLoad, _Mapping]] = ...) -> None: ...
