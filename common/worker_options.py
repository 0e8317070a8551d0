"""What a data plane worker is built from (``WorkerOptions``) and where it sits in a
tensor-parallel group (``ParallelOptions``): the one definition behind the ``--model``,
``--device``, ``--max-num-seqs``, ... options of ``headrace serve`` and ``headrace
dataplane``, the argv with which ``serve`` starts its children, and ``headrace.dataplane.worker``."""

from __future__ import annotations

import dataclasses

from headrace.common.options import DEVICE, MODEL, PARALLEL, SCHEDULING, option


@dataclasses.dataclass
class WorkerOptions:
    model: str = option(help="a Hugging Face checkpoint: a local directory, or a Hub id "
                             "(org/name or org/name@revision, fetched into the Hugging Face "
                             "cache; HF_TOKEN for gated models) (default: the embedded tiny model)",
                        group=MODEL)
    device: str = option("auto", "auto (CUDA when a GPU is visible, else cpu), cpu, cuda or cuda:N "
                                 "(default auto)", group=DEVICE)
    dtype: str | None = option(None, "the weights' and activations' type (default float32 on CPU, "
                                     "bfloat16 on CUDA)",
                               choices=("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
                               group=MODEL)
    block_size: int = option(16, "tokens per KV block", group=DEVICE)
    max_model_len: int | None = option(None, "longest sequence, prompt and output (default: the "
                                             "model's max_position_embeddings)", group=MODEL)
    num_kv_blocks: int | None = option(None, "fix the KV pool size instead of measuring", group=DEVICE)
    max_num_seqs: int = option(256, "sequences one step may hold: the scheduler runs at most this "
                                    "many, the worker sizes its batch and CUDA graphs for it",
                               synonyms=("--max-running",), group=SCHEDULING)
    max_batched_tokens: int = option(2048, "tokens one step may compute; longer prompts are "
                                           "prefilled in chunks (the worker warms up with it)",
                                     group=SCHEDULING)
    cpu_kv_cache_gib: float = option(1.0, "KV cache size on CPU (GiB)", group=DEVICE)
    gpu_memory_utilization: float = option(0.9, "fraction of GPU memory for weights, "
                                                 "activations and the KV cache", group=DEVICE)
    cuda_graphs: bool = option(True, "capture steps in CUDA graphs (default; --no-cuda-graphs "
                                     "runs every step eagerly, as --enforce-eager)", group=DEVICE)
    enforce_eager: bool = option(False, "no CUDA graphs at all: every step runs eagerly (vLLM's "
                                        "name; the same as --cudagraph-mode none)", group=DEVICE)
    cudagraph_mode: str = option(
        "full_and_piecewise", "which steps replay CUDA graphs: full_and_piecewise (decode steps "
        "a full graph, prefill and mixed steps piecewise graphs with attention between the "
        "pieces), full_decode_only (decode steps only), piecewise (every step piecewise), "
        "full (decode steps the decode graphs, prefill and mixed steps one whole graph per "
        "bucket, attention inside), none (vLLM's CUDAGraphMode)",
        choices=("full_and_piecewise", "full_decode_only", "piecewise", "full", "none"), group=DEVICE)
    max_cudagraph_capture_size: int | None = option(
        None, "largest step, in tokens, the piecewise or full step graphs cover (default: "
              "--max-batched-tokens, at most 4096); larger steps run eagerly", group=DEVICE)
    seed: int = option(0, "the worker's random seed (requests without a seed)", group=MODEL)
    speculative_config: str | None = option(
        None, 'speculative decoding, as JSON (vLLM\'s): {"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or '
              '{"method": "draft_model", "model": DRAFT_DIR, "num_speculative_tokens": 4}; '
              '"disable_by_batch_size" (default 32) and "min_acceptance" (default 0.15) tune '
              'the back-off (default: off; docs/speculative.md)', group=MODEL)
    quantization: str | None = option(
        None, "weight quantization (default: the checkpoint's quantization_config); fp8 and int8 "
        "quantize a float checkpoint at load", choices=("fp8", "int8", "gptq", "awq", "compressed-tensors"),
        group=MODEL)
    quant_backend: str = option(
        "auto", "kernels of the quantized layers on the GPU: auto (per layer shape and batch size, "
        "the fastest measured on the device among those installed: kernels/quant_dispatch.json), "
        "triton (ours), torch (tinygemm INT4, _scaled_mm FP8), gemlite (pip install "
        "'headrace[gemlite]') or fbgemm (pip install 'headrace[fbgemm]'); docs/quantization.md",
        choices=("auto", "triton", "torch", "gemlite", "fbgemm"), group=DEVICE)
    kv_offloading_size: float = option(0.0, "GiB of host memory (pinned on CUDA) per data plane "
                                            "for a second KV tier: evicted prefix-cache blocks and "
                                            "swapped-out sequences (default 0: none; vLLM's name)",
                                       group=DEVICE)
    kv_cache_dtype: str = option("auto", "KV cache element type: auto (the model dtype) or fp8 "
                                 "(e4m3 with per-tensor scales: twice the tokens; fp8_e4m3 is vLLM's "
                                 "name for it)",
                                 choices=("auto", "fp8", "fp8_e4m3"),
                                 group=DEVICE)
    attention_backend: str = option(
        "auto", "attention kernels: auto (per phase, what measured fastest on the device: "
        "flash-attn-4 for long prefills when installed, Triton otherwise), triton, or flash-attn "
        "(flash-attn-4 for every prefill; pip install 'headrace[flash-attn]'); decodes run "
        "Triton's kernel (kernels/attention_policy.py)", choices=("auto", "triton", "flash-attn"),
        group=DEVICE)
    enable_lora: bool = option(False, "serve LoRA adapters on top of the model: adapter slots on "
                                      "the device, a host cache, the LoRA kernels (vLLM's name; "
                                      "docs/lora.md)", group=MODEL)
    max_loras: int = option(1, "LoRA adapters one step may mix: device slots, each of "
                               "--max-lora-rank (vLLM's name and default)", group=MODEL)
    max_lora_rank: int = option(16, "the largest LoRA rank served (slots are padded to it; "
                                    "vLLM's name and default)", group=MODEL)
    max_cpu_loras: int | None = option(None, "LoRA adapters kept in host memory, ready to load "
                                             "into a slot (default: --max-loras; vLLM's name)",
                                       group=MODEL)
    deterministic: bool = option(
        False, "batch-invariant kernels: a request's tokens and logprobs depend only on the "
               "model, its prompt, its sampling parameters and its seed (unseeded requests "
               "sample with seed 0), whatever else runs beside it; refuses quantized weights and "
               "flash-attn-4 (docs/determinism.md)", group=DEVICE)


@dataclasses.dataclass
class ParallelOptions:
    rank: int = option(0, "this worker's tensor-parallel rank", group=PARALLEL)
    world_size: int = option(1, "tensor-parallel ranks of the group", group=PARALLEL)
    dist_init: str | None = option(None, "process group rendezvous, tcp://MASTER_HOST:PORT "
                                         "(rank 0 listens there)", group=PARALLEL)
    dist_timeout: float = option(300.0, "seconds the rendezvous and each collective may take "
                                        "before failing", group=PARALLEL)
