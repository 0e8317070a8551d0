"""The ``headrace`` command: ``serve`` (control plane plus data plane children), ``controlplane``
and ``dataplane`` (each plane alone), ``generate`` (a streaming client), ``admin`` (the Admin
service: configuration, drain, resume, reload) and ``health`` (a grpc.health.v1 probe for
container health checks)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pathlib
import secrets
import signal
import sys
import tempfile

from controlplane.cli_options import (add_engine_args, add_ops_args, add_security_args,
                                      add_tls_args, add_worker_args, default_model, engine_config,
                                      plane_options)
from controlplane.logs import configure_logging


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(args, listen: str, rank: int = 0, dist_init: str | None = None) -> list[str]:
    world, device, metrics = args.tensor_parallel_size, args.device, args.dataplane_metrics_port
    if world > 1 and device.startswith("cuda"):
        device = f"cuda:{rank}"
    argv = [sys.executable, "-m", "controlplane.cli", "dataplane", "--model", args.model,
            "--listen", listen, "--device", device, "--block-size", str(args.block_size),
            "--cpu-kv-cache-gib", str(args.cpu_kv_cache_gib),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--max-num-seqs", str(args.max_running),
            "--max-batched-tokens", str(args.max_batched_tokens),
            "--metrics-port", str(metrics + rank if metrics else 0)]
    if world > 1:
        argv += ["--rank", str(rank), "--world-size", str(world), "--dist-init", dist_init]
    if args.log_format:
        argv += ["--log-format", args.log_format]
    if args.no_cuda_graphs:
        argv.append("--no-cuda-graphs")
    for flag, value in (("--dtype", args.dtype), ("--num-kv-blocks", args.num_kv_blocks),
                        ("--max-model-len", args.max_model_len),
                        ("--quantization", args.quantization),
                        ("--kv-cache-dtype", args.kv_cache_dtype)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def cmd_serve(args) -> int:
    from controlplane import tracing
    from controlplane.server import serve_until_signal
    from controlplane.supervisor import DataPlaneChildren

    args.model = args.model or default_model()
    sock_dir = tempfile.mkdtemp(prefix="headrace-")
    world = args.tensor_parallel_size
    listens = [f"unix:{sock_dir}/dataplane-{r}.sock" for r in range(world)]
    # the children accept only this control plane: a fresh shared secret, passed by environment
    args.worker_secret = args.worker_secret or os.environ.get("HEADRACE_WORKER_SECRET") or secrets.token_hex(16)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", HEADRACE_WORKER_SECRET=args.worker_secret)

    def argvs() -> list[list[str]]:   # a fresh rendezvous port each time the group starts
        dist_init = f"tcp://127.0.0.1:{_free_port()}" if world > 1 else None
        return [_worker_argv(args, listen, r, dist_init) for r, listen in enumerate(listens)]

    children = DataPlaneChildren(argvs, env)
    tracing.setup_tracing("headrace-controlplane")
    try:
        asyncio.run(serve_until_signal(args.model, listens, f"{args.host}:{args.port}",
                                       engine_config(args), **plane_options(args)))
    finally:
        tracing.shutdown_tracing()
        children.stop()
    return 0


def cmd_controlplane(args) -> int:
    from controlplane import tracing
    from controlplane.server import serve_until_signal

    tracing.setup_tracing("headrace-controlplane")
    try:
        asyncio.run(serve_until_signal(args.model or default_model(), args.workers.split(","),
                                       f"{args.host}:{args.port}", engine_config(args),
                                       **plane_options(args)))
    finally:
        tracing.shutdown_tracing()
    return 0


def cmd_dataplane(args) -> int:
    import threading

    from controlplane import tracing
    from dataplane import parallel
    from dataplane.server import serve
    from dataplane.worker import Worker, WorkerOptions

    rank, world = args.rank, args.world_size
    if world > 1 and not args.dist_init:
        raise SystemExit("--world-size > 1 needs --dist-init tcp://MASTER_HOST:PORT")
    device = f"cuda:{rank}" if world > 1 and args.device == "cuda" else args.device
    opts = WorkerOptions(model=args.model or default_model(), device=device, dtype=args.dtype,
                         block_size=args.block_size, max_model_len=args.max_model_len,
                         num_kv_blocks=args.num_kv_blocks, cpu_kv_cache_gib=args.cpu_kv_cache_gib,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                         cuda_graphs=not args.no_cuda_graphs, quantization=args.quantization,
                         kv_cache_dtype=args.kv_cache_dtype)
    tracing.setup_tracing("headrace-dataplane")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    # listen at once (health NOT_SERVING) so probes see the model loading, not a closed port
    from controlplane import security

    server = serve(None, args.listen, metrics_port=args.metrics_port or None,
                   credentials=security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
                   secret=args.secret or os.environ.get("HEADRACE_WORKER_SECRET") or None)
    log = logging.getLogger("headrace.dataplane")
    log.info("data plane on %s: loading %s", args.listen, opts.model)
    def make_worker():
        import torch

        parallel.init(rank, world, args.dist_init, torch.device(device), args.dist_timeout)
        return Worker(opts, rank, world)

    worker = server.worker_service.load(make_worker)
    log.info("data plane on %s: %s ready, %d KV blocks (%.1fs)", args.listen, worker.cfg.name,
             worker.runner.num_blocks, worker.startup_seconds)
    done.wait()
    server.stop(grace=2).wait()
    server.worker_service.metrics.close()
    tracing.shutdown_tracing()
    if args.listen.startswith("unix:"):
        pathlib.Path(args.listen[5:]).unlink(missing_ok=True)
    return 0


def cmd_generate(args) -> int:
    from controlplane.client import stream_generate

    return asyncio.run(stream_generate(args))


def cmd_health(args) -> int:
    """Exit 0 when ``--service`` is SERVING at ``--address``, 1 otherwise (container probes)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(args.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address} {args.service or '(server)'}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve a model: control plane plus a data plane child process")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded tiny model)")
    add_engine_args(p)
    add_worker_args(p)
    add_ops_args(p, 9400, control=True)
    add_security_args(p)
    p.add_argument("--dataplane-metrics-port", type=int, default=9401,
                   help="the data plane child's /metrics port, rank r on port + r (0 disables)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="data plane processes (ranks) sharing the model; cuda:r for rank r")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("controlplane", help="run the control plane alone")
    p.add_argument("--model", default=None, help="model directory (for the tokenizer)")
    p.add_argument("--workers", default=os.environ.get("HEADRACE_WORKERS"),
                   required=not os.environ.get("HEADRACE_WORKERS"),
                   help="comma-separated data plane addresses (default $HEADRACE_WORKERS)")
    p.add_argument("--max-model-len", type=int, default=None)
    add_engine_args(p)
    add_ops_args(p, 9400, control=True)
    add_security_args(p)
    p.set_defaults(func=cmd_controlplane)

    p = sub.add_parser("dataplane", help="run one data plane worker alone")
    p.add_argument("--model", default=None)
    p.add_argument("--listen", default="127.0.0.1:50061", help="host:port or unix:/path (default private)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences one step may hold")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="tokens one step may compute")
    p.add_argument("--rank", type=int, default=0, help="this worker's tensor-parallel rank")
    p.add_argument("--world-size", type=int, default=1, help="tensor-parallel ranks of the group")
    p.add_argument("--dist-init", default=None,
                   help="process group rendezvous, tcp://MASTER_HOST:PORT (rank 0 listens there)")
    p.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds the rendezvous and each collective may take before failing")
    add_worker_args(p)
    add_ops_args(p, 9401, control=False)
    add_tls_args(p)
    p.add_argument("--secret", default=None,
                   help="serve only callers presenting this shared secret (default $HEADRACE_WORKER_SECRET)")
    p.set_defaults(func=cmd_dataplane)

    p = sub.add_parser("generate", help="stream a completion from a running server")
    p.add_argument("prompt")
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the server to be ready")
    p.set_defaults(func=cmd_generate)

    from controlplane.admin import add_admin_parser

    add_admin_parser(sub)

    p = sub.add_parser("health", help="check a server's grpc.health.v1 status (exit 0 when SERVING)")
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--service", default="", help="service name (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(func=cmd_health)

    args = parser.parse_args(argv)
    if args.command not in ("health", "generate", "admin"):
        configure_logging(getattr(args, "log_format", None))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
