"""What the workers' reports (``WorkerInfo``) and the engine's settings make of the control
plane's state: the KV block pool (device blocks, the host tier and its cost rule), the longest
request served and the scheduler's limits. Each is the smaller of what is configured and what
every worker can hold, so a step never asks a worker for more than it has; and every request
fits the pool alone, so preemption always makes progress."""

from __future__ import annotations

from headrace.common import speculative
from headrace.controlplane.kv import host_tier, tier_cost
from headrace.controlplane.engine import speculation
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.engine.config import EngineConfig
from headrace.controlplane.scheduling.scheduler import Scheduler
from headrace.worker.v1 import worker_pb2 as wpb


def build_scheduler(cfg: EngineConfig, infos: list[wpb.WorkerInfo],
                    num_kv_blocks: int) -> tuple[Scheduler, int]:
    """The scheduler over a new block pool of ``num_kv_blocks`` (each rank's shard), and the
    longest request (prompt and output tokens) it serves."""
    info = infos[0]
    host = 0 if cfg.kv_offloading_policy == "off" else min(i.num_host_kv_blocks for i in infos)
    blocks = BlockManager(num_kv_blocks, info.block_size, cfg.enable_prefix_cache, host_blocks=host)
    cost = tier_cost.TierCost.for_workers(cfg.kv_offloading_policy, infos, blocks)
    blocks.offload_evicted = cost is None or cost.keeps_evicted()
    host_tier.report(blocks, cfg.preemption_mode, cost)
    limit = min(info.max_model_len, blocks.num_blocks * blocks.block_size)
    max_model_len = min(cfg.max_model_len or limit, limit)
    max_running = min([cfg.max_running] + [i.max_num_seqs for i in infos if i.max_num_seqs])
    max_tokens = min([cfg.max_batched_tokens] + [i.max_batched_tokens for i in infos
                                                  if i.max_batched_tokens])
    spec = speculative.from_proto(info.speculative)   # the worker's configuration
    scheduler = Scheduler(blocks, max_running, max_tokens, cfg.policy, cfg.watermark,
                          fair_share=cfg.fair_share,
                          speculation=spec and speculation.Speculation(spec, max_model_len),
                          preemption_mode=cfg.preemption_mode, tier_cost=cost, chunking=cfg.chunking)
    return scheduler, max_model_len
