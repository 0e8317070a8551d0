"""The ``headrace`` command line's options: the argument groups the commands share (worker,
engine, TLS and security, operations) and the configuration objects built from them."""

from __future__ import annotations

import argparse
import os

from controlplane.engine import EngineConfig
from controlplane.logs import LOG_FORMATS
from controlplane.policy import POLICIES, Policy


def default_model() -> str:
    """$HEADRACE_MODEL (containers), else the embedded tiny model."""
    if os.environ.get("HEADRACE_MODEL"):
        return os.environ["HEADRACE_MODEL"]
    from dataplane.default_model import default_model_dir

    return str(default_model_dir())


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default=None, help="float32|bfloat16|float16 (default fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size instead of measuring")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=1.0, help="KV cache size on CPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    p.add_argument("--quantization", default=None,
                   choices=["fp8", "int8", "gptq", "awq", "compressed-tensors"],
                   help="weight quantization (default: the checkpoint's quantization_config); fp8 "
                        "and int8 quantize a float checkpoint at load")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache element type: auto (the model dtype) or fp8 (e4m3, twice the tokens)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-running", type=int, default=256, help="sequences per step at most")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="tokens per step at most; longer prompts are prefilled in chunks")
    p.add_argument("--policy", choices=POLICIES, default="fifo", help="scheduling policy")
    p.add_argument("--aging-rate", type=float, default=None,
                   help="rank units a second of waiting is worth (default per policy)")
    p.add_argument("--max-queue-delay", type=float, default=None,
                   help="seconds after which a waiting request is admitted ahead of the policy order")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable automatic prefix caching")
    p.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of KV blocks that admission leaves free for running requests")


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", default=None,
                   help="require client certificates signed by this CA (mutual TLS)")


def add_security_args(p: argparse.ArgumentParser) -> None:
    add_tls_args(p)
    p.add_argument("--api-token", default=None,
                   help="require 'authorization: Bearer TOKEN' on the public API (default $HEADRACE_API_TOKEN)")
    p.add_argument("--worker-secret", default=None,
                   help="shared secret presented to the data planes (default $HEADRACE_WORKER_SECRET)")
    p.add_argument("--worker-ca", default=None, help="verify the data planes' TLS certificates with this CA")
    p.add_argument("--worker-cert", default=None, help="client certificate for data planes with mutual TLS")
    p.add_argument("--worker-key", default=None, help="its private key")


def add_ops_args(p: argparse.ArgumentParser, metrics_port: int, control: bool) -> None:
    p.add_argument("--metrics-port", type=int, default=metrics_port,
                   help=f"Prometheus /metrics HTTP port (0 disables; default {metrics_port})")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                   help="json or console (default: console on a terminal, json otherwise)")
    if control:
        p.add_argument("--max-queued", type=int, default=0,
                       help="waiting sequences at most; beyond, RESOURCE_EXHAUSTED (0: unbounded)")
        p.add_argument("--outage-deadline", type=float, default=60.0,
                       help="seconds requests wait for a lost data plane before UNAVAILABLE")
        p.add_argument("--stream-interval", type=positive_int, default=1,
                       help="tokens per streamed message at least, for requests that do not set "
                            "stream_interval (default 1: every token as it is sampled)")
        p.add_argument("--pipeline-depth", type=positive_int, default=3,
                       help="steps in flight (default 3: the data plane always holds the next "
                            "step; 2 while a running request has stop strings)")
        p.add_argument("--no-overlap", action="store_true",
                       help="one step in flight (no overlapped scheduling)")
        p.add_argument("--admin-token", default=None,
                       help="bearer token for the Admin service (default $HEADRACE_ADMIN_TOKEN; "
                            "without one, Admin serves local callers only)")
        p.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default)")
        p.add_argument("--disable-log-requests", action="store_true",
                       help="no log line per finished request")


def plane_options(args) -> dict:
    """ControlPlane keyword options from the command line."""
    from controlplane import security

    return dict(metrics_port=args.metrics_port or None,
                admin_token=args.admin_token or os.environ.get("HEADRACE_ADMIN_TOKEN") or None,
                log_requests=not args.disable_log_requests, log_prompts=args.log_prompts,
                api_token=args.api_token or os.environ.get("HEADRACE_API_TOKEN") or None,
                tls=security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
                worker_credentials=security.channel_credentials(args.worker_ca, args.worker_cert,
                                                                args.worker_key),
                worker_secret=args.worker_secret or os.environ.get("HEADRACE_WORKER_SECRET") or None)


def engine_config(args) -> EngineConfig:
    return EngineConfig(max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
                        max_model_len=getattr(args, "max_model_len", None),
                        policy=Policy(args.policy, args.aging_rate, args.max_queue_delay),
                        enable_prefix_cache=not args.no_prefix_cache, watermark=args.watermark,
                        max_queued=args.max_queued, outage_deadline_s=args.outage_deadline,
                        pipeline_depth=1 if args.no_overlap else args.pipeline_depth,
                        stream_interval=args.stream_interval)
