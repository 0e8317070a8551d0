"""The role commands the supervisor starts as children (``python -m headrace.cli
core|frontend|dataplane``): an engine core, an API front end and a data plane, each one process that
runs its server until a signal. Only ``dataplane`` imports the data plane (and torch), inside the
command."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
import signal
import sys

from headrace.cli.configs import (check_speculative_config, check_structured_outputs_backend,
                                  core_link_options, engine_config, placement_of, plane_options)
from headrace.cli.options import default_model
from headrace.common.options import from_args
from headrace.common.worker_options import ParallelOptions, WorkerOptions

# set by ``headrace serve`` / ``controlplane`` in their children's environment: the command
# the user ran, which a child's one-line failure names (not the role command it runs as)
SUPERVISOR_ENV = "HEADRACE_SUPERVISOR"


def child_command(role: str) -> list[str]:
    """How the supervisor starts a child of ``role``: this interpreter running ``headrace.cli``
    with ``-P``, which keeps the current directory off ``sys.path``: a ``headrace/`` folder
    where ``serve`` was started (the clone's parent, say) would otherwise stand in for the
    installed package in every child (``No module named 'headrace.worker.v1'``)."""
    return [sys.executable, "-P", "-m", "headrace.cli", role]


def failure_label(args) -> str:
    """How a command's one-line failure on stderr begins: ``headrace COMMAND``, or for a
    child of ``headrace serve``, ``headrace serve: data plane`` (``engine core``, ``engine core
    i`` of several, ``API front end i``, ``data plane rank r``): the user ran serve and must see
    it named."""
    parent = os.environ.get(SUPERVISOR_ENV)
    if not parent or args.command not in ("core", "frontend", "dataplane"):
        return f"headrace {args.command}"
    role = {"core": "engine core", "frontend": f"API front end {getattr(args, 'index', 0)}",
            "dataplane": "data plane"}[args.command]
    if args.command == "dataplane" and getattr(args, "world_size", 1) > 1:
        role += f" rank {args.rank}"
    if args.command == "core" and getattr(args, "data_parallel_size", 1) > 1:
        role += f" {args.data_parallel_rank}"   # which of the data-parallel cores
    return f"headrace {parent}: {role}"


def _run_role(server_factory) -> int:
    """Runs the server ``server_factory()`` builds (inside the event loop) until a signal."""
    from headrace.common import tracing
    from headrace.controlplane.lifecycle import run_until_signal

    async def run():
        await run_until_signal(server_factory())

    tracing.setup_tracing("headrace-controlplane")
    try:
        asyncio.run(run())
    finally:
        tracing.shutdown_tracing()
    return 0


def cmd_core(args) -> int:
    from headrace.controlplane.core.server import CoreServer

    check_structured_outputs_backend(args)
    opts = plane_options(args)
    keys = ("metrics_port", "metrics_host", "admin_token", "log_requests", "log_prompts",
            "worker_credentials", "worker_secret", "chat_template", "generation_config",
            "admin_insecure_loopback", "model_roots")
    return _run_role(lambda: CoreServer(args.model or default_model(), args.workers.split(","),
                                        args.core_address, engine_config(args),
                                        **{k: opts[k] for k in keys}, **core_link_options(args, "core"),
                                        data_parallel_rank=args.data_parallel_rank,
                                        data_parallel_size=args.data_parallel_size))


def cmd_frontend(args) -> int:
    from headrace.controlplane.frontend.server import FrontEnd

    opts = plane_options(args)
    keys = ("api_token", "tls", "admin_token", "http_port", "http_tls", "chat_template",
            "generation_config", "log_prompts", "trust_tenant_header", "max_n", "max_prompts",
            "http_timeouts", "admin_insecure_loopback")
    return _run_role(lambda: FrontEnd(args.index, args.core_address, args.model or default_model(),
                                      f"{args.host}:{args.port}", max_model_len=getattr(args, "max_model_len", None),
                                      **{k: opts[k] for k in keys},
                                      **core_link_options(args, "frontend"),
                                      placement=placement_of(args),
                                      outage_deadline=args.outage_deadline,
                                      drain_timeout=args.drain_timeout))


def cmd_dataplane(args) -> int:
    import threading

    from headrace.cli.supervisor import EXIT_LOAD_FAILED
    from headrace.common import security, tracing
    from headrace.common.model_source import check_checkpoint, resolve_model
    from headrace.dataplane import parallel
    from headrace.dataplane.server import serve
    from headrace.dataplane.worker import Worker, check_device, load_failure, resolve_device

    check_speculative_config(args)
    par = from_args(ParallelOptions, args)
    rank, world = par.rank, par.world_size
    if world > 1 and not par.dist_init:
        raise ValueError("--world-size > 1 needs --dist-init tcp://MASTER_HOST:PORT")
    device = resolve_device(args.device)   # auto: cuda when a GPU is visible
    device = f"cuda:{rank}" if world > 1 and device == "cuda" else device
    opts = from_args(WorkerOptions, args, model=args.model or default_model(), device=device)
    try:   # what cannot load is one line and EXIT_LOAD_FAILED (``serve`` then says no more)
        check_device(device)
        opts = dataclasses.replace(opts, model=resolve_model(opts.model))
        check_checkpoint(opts.model, tokenizer=False)
    except ValueError as exc:
        print(f"{failure_label(args)}: {exc}", file=sys.stderr)
        return EXIT_LOAD_FAILED
    tracing.setup_tracing("headrace-dataplane")
    done = threading.Event()

    def on_signal(sig, _frame):
        if done.is_set() and sig == signal.SIGINT:   # a second Ctrl-C: at once
            os._exit(130)
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    metrics_host = args.metrics_host or "127.0.0.1"   # never the --listen host unless asked
    # listen at once (health NOT_SERVING) so probes see the model loading, not a closed port
    server = serve(None, args.listen, metrics_port=args.metrics_port or None, metrics_host=metrics_host,
                   credentials=security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
                   secret=args.worker_secret)   # (or its variables: headrace.common.secret_env, headrace.cli.main)
    log = logging.getLogger("headrace.dataplane")
    log.info("data plane on %s: loading %s", args.listen, opts.model)

    def make_worker():
        import torch

        parallel.init(rank, world, par.dist_init, torch.device(device), par.dist_timeout)
        return Worker(opts, rank, world)

    try:
        worker = server.worker_service.load(make_worker)
    except Exception as exc:  # noqa: BLE001 - any load failure is one line, not a traceback
        log.debug("loading failed", exc_info=True)
        print(f"{failure_label(args)}: {load_failure(exc, opts)}", file=sys.stderr)
        worker, code = None, EXIT_LOAD_FAILED
    else:
        log.info("data plane on %s: %s ready in %.1fs (%s), %d KV blocks", args.listen,
                 worker.cfg.name, worker.startup_seconds, worker.phases.summary(),
                 worker.runner.num_blocks)
        done.wait()
        code = 0
    server.stop(grace=2 if worker else 0).wait()
    server.worker_service.metrics.close()
    tracing.shutdown_tracing()
    if args.listen.startswith("unix:"):
        pathlib.Path(args.listen[5:]).unlink(missing_ok=True)
    return code
