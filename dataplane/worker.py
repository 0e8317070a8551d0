"""Builds a data plane worker: reads the checkpoint, warms up with the largest step to measure
peak memory, sizes and allocates the KV cache from what is left, captures decode CUDA graphs,
and answers ``Describe``.

Under tensor parallelism (``headrace.dataplane.parallel.init`` first) a worker is one rank: it loads
its shard of the checkpoint and sizes its KV cache for its own KV heads. Its options,
``WorkerOptions``, are defined once in ``headrace.common.worker_options`` (the command line's too)."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time

import torch

from headrace import kernels
from headrace.common import speculative
from headrace.common.import_errors import import_failure
from headrace.common.worker_options import WorkerOptions
from headrace.dataplane import (draft_model, graph_capture, kv_cache, kv_offload, lora, parallel,
                                prefill_profile)
from headrace.dataplane.config import ModelConfig, load_model_config
from headrace.dataplane.cuda_graphs import batch_sizes
from headrace.dataplane.draft_model import DraftModel
from headrace.dataplane.loader import load_model
from headrace.dataplane.model import AttentionMetadata, CausalLM
from headrace.dataplane.progress import Phases, Progress
from headrace.dataplane.quantization import (FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES,
                                             layers as quant_layers)
from headrace.dataplane.quantization import resolve as resolve_quantization
from headrace.dataplane.runner import ModelRunner
from headrace.dataplane.sampler import SamplingBatch, SamplingRow, sample
from headrace.dataplane.spec_decode import SpecDecoder, graph_rows
from headrace.kernels import attention_policy, kv_layout, quant_dispatch, quant_libs
from headrace.worker.v1 import worker_pb2 as pb

log = logging.getLogger("headrace.dataplane")
# What this process's CUDA context may take before its first tensor: memory in use on the GPU
# at start beyond it belongs to other processes (another replica sharing the GPU) and is not
# counted against this one's --gpu-memory-utilization.
CUDA_CONTEXT_BYTES = 1 << 30
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str) -> str:
    """``auto`` is cuda when torch sees a GPU, else cpu; any other name is kept."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> None:
    """ValueError (one line, saying what to do) unless ``device`` is cpu or a visible GPU."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(f"--device {device}: headrace runs on cpu or cuda[:N]")
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "no GPU or driver found"
        raise ValueError(f"--device {device}: no CUDA GPU is visible ({why}); use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


def load_failure(exc: BaseException, opts: "WorkerOptions") -> str:
    """One line for a model that failed to load: what failed, which path (on which device
    ``auto`` picked), what to do."""
    opts = dataclasses.replace(opts, device=resolve_device(opts.device))
    if isinstance(exc, torch.OutOfMemoryError):
        return (f"cannot load {opts.model} on {opts.device}: out of memory; lower "
                f"--gpu-memory-utilization or --max-model-len, or shard it (--tensor-parallel-size)")
    if isinstance(exc, ValueError) and str(exc).startswith("--"):
        return str(exc)   # an option's own message
    if isinstance(exc, ImportError):   # a missing library, or another distribution's module
        return f"cannot load the model in {opts.model} on {opts.device}: {import_failure(exc)}"
    detail = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
    return f"cannot load the model in {opts.model} on {opts.device}: {detail}"


class Worker:
    def __init__(self, opts: WorkerOptions, rank: int = 0, world_size: int = 1):
        start = time.perf_counter()
        opts = dataclasses.replace(opts, device=resolve_device(opts.device))
        check_device(opts.device)
        self.opts = opts
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(opts.device)
        dtype_name = opts.dtype or ("float32" if self.device.type == "cpu" else "bfloat16")
        if dtype_name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype_name!r}; choose from {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype_name]
        torch.manual_seed(opts.seed)
        if world_size != parallel.world_size() or rank != parallel.rank():
            raise RuntimeError(f"rank {rank} of {world_size}: the process group is not initialised "
                               f"(headrace.dataplane.parallel.init)")
        self.speculative = speculative.parse(opts.speculative_config)
        lora.check_options(opts)
        mode = graph_capture.resolve_mode(opts)   # CUDA graphs exist on CUDA devices only
        self.graph_mode = mode if self.device.type == "cuda" else "none"
        if opts.enable_lora and self.graph_mode != "none" and not kernels.on_triton(self.device):
            log.warning("LoRA with HEADRACE_KERNELS=%s: the LoRA reference reads each step's groups "
                        "on the host, so no CUDA graphs are captured", kernels.MODE)
            self.graph_mode = "none"
        self.cfg: ModelConfig = load_model_config(opts.model)
        drafting = self.speculative is not None and self.speculative.method == "draft_model"
        if drafting:
            draft_dir = draft_model.check_options(self.speculative, self.cfg, world_size,
                                                  opts.kv_offloading_size)
        self.shard = parallel.Shard.of(self.cfg, rank, world_size)
        self.local_cfg = self.shard.local_config(self.cfg)   # this rank's heads and MLP columns
        self.max_model_len = opts.max_model_len or self.cfg.max_position_embeddings
        self.phases = phases = Phases()
        self.quant = resolve_quantization(opts.model, opts.quantization)
        if self.quant is not None:
            backend = quant_dispatch.resolve_backend(opts.quant_backend, self.device.type,
                                                     quant_libs.why_not)
            self.quant = dataclasses.replace(self.quant, backend=backend)
        if opts.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {opts.kv_cache_dtype!r}: choose from {KV_CACHE_DTYPES}")
        self.kv_dtype = torch.float8_e4m3fn if opts.kv_cache_dtype in FP8_KV_CACHE_DTYPES else self.dtype
        kv_layout.check_block_size(self.kv_dtype, opts.block_size)
        if opts.deterministic:
            kernels.batch_invariant.check(quantization=self.quant and self.quant.describe(),
                                          attention_backend=opts.attention_backend,
                                          lora=opts.enable_lora)
        kernels.batch_invariant.enable(opts.deterministic)   # before the model's first step
        self.attention = attention_policy.resolve(
            opts.attention_backend, self.device.type,
            None if self.device.type != "cuda" else
            "--deterministic runs the batch-invariant Triton kernels" if opts.deterministic else
            kernels.flash_attn4.unusable(self.device, self.dtype, self.kv_dtype,
                                         self.local_cfg.head_dim))
        log.info("%s", self.attention.describe())
        if opts.deterministic:
            log.info("deterministic: batch-invariant kernels (GEMMs, attention, LM head; "
                     "docs/determinism.md)")
        self.others_bytes = self._memory_of_others()   # before this process's weights and cache
        model = load_model(pathlib.Path(opts.model), self.cfg, self.device, self.dtype,
                           self.max_model_len, self.shard, self.quant)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()   # an on-the-fly quantization's float weights
        self.lora = None   # headrace.dataplane.lora.LoraRuntime (--enable-lora): slots counted in the peak
        if opts.enable_lora:
            self.lora = lora.enable(model, self.local_cfg, opts, self.dtype, self.device,
                                    max(opts.max_batched_tokens, graph_rows(self.speculative,
                                                                            opts.max_num_seqs)))
            log.info("%s", self.lora.describe())
        draft = None
        if drafting:
            draft = DraftModel.load(draft_dir, self.cfg, self.device, self.dtype,
                                    self.max_model_len)
        phases.mark("weights")
        self.block_bytes = kv_cache.bytes_per_block(self.local_cfg, opts.block_size, self.kv_dtype)
        if draft is not None:   # a block id holds the target's and the draft's KV
            self.block_bytes += draft.bytes_per_block(opts.block_size, self.kv_dtype)
        self.activation_bytes = self.peak_bytes = 0
        if self.device.type == "cuda":
            self._warm_up(model)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)   # before the graphs'
            phases.mark("warm-up")
        max_blocks = -(-self.max_model_len // opts.block_size)
        # the graphs' static buffers now, their pool counted: both stay out of the KV budget
        self.graphs = graph_capture.WorkerGraphs(
            self.graph_mode, model, self.device, graph_rows(self.speculative, opts.max_num_seqs),
            max_blocks, graph_capture.capture_tokens(opts))
        graph_reserve = self.graphs.reserve_bytes(self.activation_bytes)
        num_blocks = opts.num_kv_blocks or self._blocks_from_memory(graph_reserve)
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache")
        with Progress(f"allocating KV cache ({num_blocks} blocks, "
                      f"{num_blocks * self.block_bytes / kv_cache.GiB:.2f} GiB)",
                      self.local_cfg.num_layers, "layers", rank=rank) as progress:
            caches = kv_cache.allocate(self.local_cfg, num_blocks, opts.block_size, self.kv_dtype,
                                       self.device, progress)
        if draft is not None:
            draft.allocate(num_blocks, opts.block_size, self.kv_dtype)
        phases.mark("KV cache")
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %d bytes per block; weights: %s",
                 num_blocks, opts.block_size, num_blocks * opts.block_size, self.kv_dtype_name,
                 self.block_bytes, self.quant.describe() if self.quant else self.dtype_name)
        host_kv, self.host_load_rate = None, 0.0
        num_host = kv_offload.host_blocks_for(opts.kv_offloading_size, self.block_bytes)
        if num_host:
            with Progress(f"allocating the host KV tier ({num_host} blocks, "
                          f"{num_host * self.block_bytes / kv_cache.GiB:.2f} GiB)", 1, "pools", rank=rank) as progress:
                host_kv = kv_offload.HostKV(caches, num_host, self.device)
                self.host_load_rate = host_kv.measure_load_rate(caches)
                progress.update()
            phases.mark("host KV tier")
        log.info("host KV tier: %d blocks (%.2f GiB%s)%s", num_host, num_host * self.block_bytes / kv_cache.GiB,
                 ", pinned" if host_kv is not None and self.device.type == "cuda" else "",
                 f", loads at {self.host_load_rate / 1e9:.1f} GB/s" if host_kv is not None else "")
        if self.graphs.num_graphs:
            self.graphs.capture(caches, rank)
            if draft is not None:   # the draft's decodes are as launch-bound as the target's
                rows = graph_rows(self.speculative, opts.max_num_seqs)
                with Progress("capturing the draft's CUDA graphs", len(batch_sizes(rows)), "graphs",
                              rank=rank) as progress:
                    draft.capture_graphs(rows, max_blocks, progress)
            phases.mark("CUDA graphs")
        spec = SpecDecoder(self.speculative, draft) if self.speculative is not None else None
        self.runner = ModelRunner(model, caches, opts.block_size, self.device, self.max_model_len,
                                  opts.max_num_seqs, self.graphs.decode, rank=rank, seed=opts.seed,
                                  spec=spec, attention=self.attention, host_kv=host_kv,
                                  mixed=self.graphs.mixed, deterministic=opts.deterministic)
        self.prefill_profile: tuple[list[int], list[float]] = ([], [])
        if host_kv is not None:   # what recomputing a host-tier hit costs here
            tokens = prefill_profile.sizes(opts.max_batched_tokens, self.max_model_len, num_blocks,
                                           opts.block_size, self.device)
            self.prefill_profile = (tokens, prefill_profile.measure(self.runner, tokens, self.cfg.vocab_size))
            phases.mark("prefill profile")
        self.startup_seconds = time.perf_counter() - start

    @torch.inference_mode()
    def _warm_up(self, model: CausalLM) -> None:
        """Runs the largest step (max_batched_tokens tokens, max_num_seqs sampled with every
        filter on) against a one-block cache, so peak activation memory can be measured."""
        n, dev = self.opts.max_batched_tokens, self.device
        if self.quant is not None:   # library layouts, skinny-GEMM tuning per row bucket
            for line in quant_layers.warm_up(model, graph_rows(self.speculative,
                                                               self.opts.max_num_seqs), self.dtype):
                log.info("quantized %s", line)
        cache = kv_cache.allocate(self.local_cfg, 1, self.opts.block_size, self.kv_dtype, dev)
        torch.cuda.reset_peak_memory_stats(dev)
        baseline = torch.cuda.memory_allocated(dev)
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((n, 1), dtype=torch.int32, device=dev),
            max_query_len=1, decode_only=True,
            decode_order=torch.arange(n, dtype=torch.int32, device=dev))
        if self.lora is not None:   # every token of slot 0: the LoRA kernels compiled and counted
            self.lora.every_token(n)
        hidden = model(torch.zeros(n, dtype=torch.int64, device=dev),
                       torch.zeros(n, dtype=torch.int64, device=dev), cache, meta)
        if self.lora is not None:
            self.lora.batch.begin(None, None)   # (back to no adapter)
        rows = min(n, self.opts.max_num_seqs)
        worst = SamplingRow(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.0,
                            presence_penalty=0.0, frequency_penalty=0.0, seed=1, logprobs=20,
                            min_tokens=0, stop_token_ids=[], prompt_token_ids=[0],
                            output_token_ids=[])
        logits = model.logits(hidden[:rows])
        sample(logits, SamplingBatch.of_rows([worst] * rows))
        plain = dataclasses.replace(worst, top_p=1.0, top_k=0, min_p=0.0, seed=None, logprobs=0)
        sample(logits, SamplingBatch.of_rows([plain] * rows))   # the race on the model's dtype
        self.activation_bytes = torch.cuda.max_memory_allocated(dev) - baseline
        del cache, hidden, logits
        self._compile_attention_variants()
        torch.cuda.synchronize(dev)

    def _compile_attention_variants(self) -> None:
        """Runs the prefill attention once per tile shape it can pick (they depend on the
        longest query of a step), so no request pays a Triton compilation."""
        cfg, dev, bs = self.local_cfg, self.device, self.opts.block_size
        longest = 512   # tiles stop growing at 256 query rows
        if self.opts.deterministic:   # a decode of two splits: its combine kernel compiled too
            from headrace.kernels import triton_invariant_tile
            longest = max(longest, 2 * triton_invariant_tile.SPLIT_TOKENS)
        blocks = -(-longest // bs)
        cache = kv_cache.allocate(cfg, blocks, bs, self.kv_dtype, dev)[0]
        tables = torch.arange(blocks, dtype=torch.int32, device=dev)[None, :]
        q_len = 1
        while q_len <= longest:
            query = torch.zeros((q_len, cfg.num_heads, cfg.head_dim), dtype=self.dtype, device=dev)
            kernels.paged_attention(
                query, cache, torch.tensor([0, q_len], dtype=torch.int32, device=dev),
                torch.tensor([q_len], dtype=torch.int32, device=dev), tables, cfg.head_dim ** -0.5,
                max_query_len=q_len, decode_only=q_len == 1,
                decode_order=torch.zeros(1, dtype=torch.int32, device=dev))
            q_len *= 2
        if self.opts.deterministic:
            kernels.paged_attention(
                torch.zeros((1, cfg.num_heads, cfg.head_dim), dtype=self.dtype, device=dev), cache,
                torch.tensor([0, 1], dtype=torch.int32, device=dev),
                torch.tensor([longest], dtype=torch.int32, device=dev), tables, cfg.head_dim ** -0.5,
                max_query_len=1, decode_only=True)
        if self.attention.uses_flash:   # flash-attn-4 compiles its kernels at the first call
            kernels.flash_attn4.warm_up(cache, cfg.num_heads, self.dtype, self.opts.max_num_seqs)

    def _memory_of_others(self) -> int:
        """GPU memory other processes held when this one started (0 on a CPU)."""
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, total - free - CUDA_CONTEXT_BYTES)

    def _blocks_from_memory(self, graph_reserve: int = 0) -> int:
        """KV blocks for what is left of this process's share of the device (``--gpu-memory-
        utilization`` of the whole GPU, as vLLM's): the share less the peak (weights, the
        warm-up's activations), the memory outside torch it took (other processes' memory at
        start is theirs: another replica sharing the GPU), the CUDA graphs' static buffers
        (allocated after the peak) and ``graph_reserve`` (their memory pool)."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self.peak_bytes + self.graphs.static_bytes()
            non_torch = (total - free) - torch.cuda.memory_reserved(self.device) - self.others_bytes
            budget = (int(total * self.opts.gpu_memory_utilization) - peak - max(0, non_torch)
                      - graph_reserve)
        else:
            budget = kv_cache.host_budget_bytes(self.opts.cpu_kv_cache_gib)
        return max(0, budget) // self.block_bytes

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_dtype_name(self) -> str:
        return str(self.kv_dtype).removeprefix("torch.")

    def describe(self) -> pb.WorkerInfo:
        cfg = self.cfg
        info = pb.WorkerInfo(
            model_name=cfg.name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len, dtype=self.dtype_name, kv_cache_dtype=self.kv_dtype_name,
            quantization=self.quant.describe() if self.quant else "",
            device=str(self.device), rank=self.rank, world_size=self.world_size,
            block_size=self.opts.block_size, num_kv_blocks=self.runner.num_blocks,
            num_host_kv_blocks=self.runner.host_kv.num_blocks if self.runner.host_kv else 0,
            kv_bytes_per_block=self.block_bytes, eos_token_ids=list(cfg.eos_token_ids),
            max_num_seqs=self.opts.max_num_seqs, max_batched_tokens=self.opts.max_batched_tokens,
            startup_seconds=self.startup_seconds,
            host_kv_load_bytes_per_s=self.host_load_rate,
            prefill_profile_tokens=self.prefill_profile[0], prefill_profile_seconds=self.prefill_profile[1],
            deterministic=self.opts.deterministic)
        if self.lora is not None:
            self.lora.describe_into(info)
        speculative.to_proto(self.speculative, info.speculative)
        return info

    def load_adapter(self, request: pb.LoadAdapterRequest) -> pb.LoadAdapterResponse:
        """Reads a LoRA adapter into the host cache (``lora.adapter.AdapterError``: it cannot be
        served; ``RuntimeError``: this worker has no LoRA slots). Runs off the step stream."""
        if self.lora is None:
            raise RuntimeError("this data plane was started without --enable-lora")
        return self.lora.read(request, self.cfg, self.shard)
