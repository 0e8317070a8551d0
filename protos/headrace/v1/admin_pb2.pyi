from headrace.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "wait_s")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    wait_s: float
    def __init__(self, lora_name: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapterState(_message.Message):
    __slots__ = ("adapter", "running", "waiting", "in_slot", "cached")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_SLOT_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    adapter: _inference_pb2.LoraAdapter
    running: int
    waiting: int
    in_slot: bool
    cached: bool
    def __init__(self, adapter: _Optional[_Union[_inference_pb2.LoraAdapter, _Mapping]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., in_slot: _Optional[bool] = ..., cached: _Optional[bool] = ...) -> None: ...

class LoraAdapters(_message.Message):
    __slots__ = ("adapters", "max_loras", "max_cpu_loras", "max_lora_rank")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterState]
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterState, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class GetConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulingPolicy(_message.Message):
    __slots__ = ("name", "aging_rate", "max_queue_delay_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGING_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    aging_rate: float
    max_queue_delay_s: float
    def __init__(self, name: _Optional[str] = ..., aging_rate: _Optional[float] = ..., max_queue_delay_s: _Optional[float] = ...) -> None: ...

class Config(_message.Message):
    __slots__ = ("model", "model_name", "policy", "max_running", "max_batched_tokens", "max_queued", "max_model_len", "kv_block_size", "num_kv_blocks", "prefix_cache", "watermark", "workers", "draining", "ready", "running", "waiting", "in_flight_requests", "worker_max_running", "worker_max_batched_tokens", "num_host_kv_blocks", "preemption_mode", "kv_offloading_policy", "host_load_seconds_per_token", "recompute_seconds_per_token", "host_hits_recomputed_tokens", "deterministic")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    WORKER_MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOADING_POLICY_FIELD_NUMBER: _ClassVar[int]
    HOST_LOAD_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HOST_HITS_RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_name: str
    policy: SchedulingPolicy
    max_running: int
    max_batched_tokens: int
    max_queued: int
    max_model_len: int
    kv_block_size: int
    num_kv_blocks: int
    prefix_cache: bool
    watermark: float
    workers: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    ready: bool
    running: int
    waiting: int
    in_flight_requests: int
    worker_max_running: int
    worker_max_batched_tokens: int
    num_host_kv_blocks: int
    preemption_mode: str
    kv_offloading_policy: str
    host_load_seconds_per_token: float
    recompute_seconds_per_token: float
    host_hits_recomputed_tokens: int
    deterministic: bool
    def __init__(self, model: _Optional[str] = ..., model_name: _Optional[str] = ..., policy: _Optional[_Union[SchedulingPolicy, _Mapping]] = ..., max_running: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., max_queued: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., watermark: _Optional[float] = ..., workers: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., ready: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., worker_max_running: _Optional[int] = ..., worker_max_batched_tokens: _Optional[int] = ..., num_host_kv_blocks: _Optional[int] = ..., preemption_mode: _Optional[str] = ..., kv_offloading_policy: _Optional[str] = ..., host_load_seconds_per_token: _Optional[float] = ..., recompute_seconds_per_token: _Optional[float] = ..., host_hits_recomputed_tokens: _Optional[int] = ..., deterministic: _Optional[bool] = ...) -> None: ...

class UpdateConfigRequest(_message.Message):
    __slots__ = ("policy", "aging_rate", "max_queue_delay_s", "max_running", "max_batched_tokens", "max_queued")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    AGING_RATE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
    policy: str
    aging_rate: float
    max_queue_delay_s: float
    max_running: int
    max_batched_tokens: int
    max_queued: int
    def __init__(self, policy: _Optional[str] = ..., aging_rate: _Optional[float] = ..., max_queue_delay_s: _Optional[float] = ..., max_running: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., max_queued: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s", "abort_remaining")
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ABORT_REMAINING_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    abort_remaining: bool
    def __init__(self, timeout_s: _Optional[float] = ..., abort_remaining: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained", "in_flight", "aborted")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    in_flight: int
    aborted: int
    def __init__(self, drained: _Optional[bool] = ..., in_flight: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadModelRequest(_message.Message):
    __slots__ = ("model", "drain_timeout_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    drain_timeout_s: float
    def __init__(self, model: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class ReloadModelResponse(_message.Message):
    __slots__ = ("model", "model_name", "num_kv_blocks", "max_model_len", "aborted", "seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_name: str
    num_kv_blocks: int
    max_model_len: int
    aborted: int
    seconds: float
    def __init__(self, model: _Optional[str] = ..., model_name: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., aborted: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("dir", "num_steps")
    DIR_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    dir: str
    num_steps: int
    def __init__(self, dir: _Optional[str] = ..., num_steps: _Optional[int] = ...) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ("wait_s",)
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    wait_s: float
    def __init__(self, wait_s: _Optional[float] = ...) -> None: ...

class ProfileStatus(_message.Message):
    __slots__ = ("recording", "dir", "num_steps", "steps_recorded", "files", "errors")
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    DIR_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECORDED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    recording: bool
    dir: str
    num_steps: int
    steps_recorded: int
    files: _containers.RepeatedScalarFieldContainer[str]
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, recording: _Optional[bool] = ..., dir: _Optional[str] = ..., num_steps: _Optional[int] = ..., steps_recorded: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...
