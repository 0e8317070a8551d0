"""``EngineConfig``: the engine's settings (scheduling limits, policy, prefill chunking, prefix
cache, queue bound, pipeline depth, streaming interval, preemption mode), from the command line
or an embedder."""

from __future__ import annotations

import dataclasses

from headrace.controlplane.scheduling.chunking import Chunking
from headrace.controlplane.scheduling.policy import Policy


@dataclasses.dataclass
class EngineConfig:
    max_running: int = 256
    max_batched_tokens: int = 2048
    max_model_len: int | None = None   # default: what the workers report (capped by the KV pool)
    policy: Policy = dataclasses.field(default_factory=Policy)
    chunking: Chunking = dataclasses.field(default_factory=Chunking)   # prefill tokens per step
    enable_prefix_cache: bool = True
    watermark: float = 0.01            # fraction of KV blocks admission leaves free
    max_queued: int | None = None      # waiting sequences at most (None: limits.default_max_queued
                                       # of the running cap; 0: unbounded); RESOURCE_EXHAUSTED beyond
    fair_share: bool = True            # tenants share running slots and KV blocks (headrace.controlplane.scheduling.fairness)
    reconnect_interval_s: float = 1.0
    pipeline_depth: int = 3            # steps in flight; 1 = no overlap (each step answered at once)
    outage_deadline_s: float = 60.0    # requests wait this long for a lost data plane to return
                                       # (or for one whose steps keep raising to recover)
    step_timeout_floor_s: float = 5.0  # a step owed longer (and far longer than any of its size)
                                       # while the data plane does not answer: NOT_SERVING
    step_hang_timeout_s: float = 60.0  # stalled this long: hung, serve restarts the data plane
                                       # (0: never)
    stream_interval: int = 1           # tokens per streamed message at least, unless a request says
    preemption_mode: str = "recompute"  # or "swap": a victim's KV waits in the host KV tier
    kv_offloading_policy: str = "auto"  # host-tier hits: loaded where cheaper (always, never; off: no tier)
    structured_outputs_backend: str = "auto"  # grammar engine: auto, guidance or xgrammar
    lora_modules: list = dataclasses.field(default_factory=list)   # (name, path): --lora-modules
    deterministic: bool = False        # --deterministic: every data plane must run batch-invariant
                                       # (also on when they all report it: Engine.deterministic)
