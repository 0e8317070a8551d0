"""The supervisor commands: ``headrace serve`` (data plane children, engine cores and API front
ends; ``--data-parallel-size`` replicas: ``headrace.cli.data_parallel``) and ``headrace
controlplane`` (the cores and front ends over running data planes). The children's roles are in
``headrace.cli.roles``, their keeping alive in ``headrace.cli.supervisor`` and
``headrace.cli.processes``."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import sys
import tempfile

from headrace.cli.configs import (check_speculative_config, check_structured_outputs_backend,
                                  chunking, lora_modules)
from headrace.cli.options import check_device_name, default_model
from headrace.cli.roles import SUPERVISOR_ENV, child_command
from headrace.common import secret_env
from headrace.common.options import from_args, to_argv
from headrace.common.worker_options import ParallelOptions, WorkerOptions


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dataplane_argv(opts: WorkerOptions, par: ParallelOptions, listen: str, metrics_port: int,
                   log_format: str | None = None, metrics_host: str = "127.0.0.1") -> list[str]:
    """The command line of a data plane child process running ``opts`` as rank ``par.rank``."""
    argv = [*child_command("dataplane"), *to_argv(opts), *to_argv(par),
            "--listen", listen, "--metrics-port", str(metrics_port), "--metrics-host", metrics_host]
    return argv + (["--log-format", log_format] if log_format else [])


def serve_children_argvs(args, listens: list[str], devices: list[str] | None = None,
                         replica: int = 0) -> list[list[str]]:
    """``headrace serve``'s data plane children of one replica: one per rank (``cuda:r`` for rank r
    under tensor parallelism on CUDA, else ``devices[r]``: ``headrace.cli.data_parallel``), with a
    fresh rendezvous port each time the group starts."""
    world, opts, metrics = args.tensor_parallel_size, from_args(WorkerOptions, args), args.dataplane_metrics_port
    dist_init = f"tcp://127.0.0.1:{_free_port()}" if world > 1 else None
    argvs = []
    for rank, listen in enumerate(listens):
        rank_opts = opts
        if devices is not None:
            rank_opts = dataclasses.replace(opts, device=devices[rank])
        elif world > 1 and opts.device.startswith("cuda"):
            rank_opts = dataclasses.replace(opts, device=f"cuda:{rank}")
        port = metrics + replica * world + rank if metrics else 0
        argvs.append(dataplane_argv(rank_opts, ParallelOptions(rank, world, dist_init), listen,
                                    port, args.log_format, args.metrics_host))
    return argvs


def dataplane_env(args, environ=os.environ) -> dict:
    """A data plane child's environment (every replica's alike): the worker secret (how it accepts
    only this control plane) and no other secret (``headrace.common.secret_env``), and the
    supervisor's name (its one-line failures name ``headrace serve``,
    ``headrace.cli.roles.failure_label``)."""
    return dict(secret_env.role_env("dataplane", args, environ), NCCL_NVLS_ENABLE="0",
                **{SUPERVISOR_ENV: "serve"})


def _model_for_the_control_plane(args, weights: bool) -> str:
    """The checkpoint directory (a Hub id resolved), checked for the files serving needs."""
    from headrace.common.model_source import check_checkpoint, resolve_model

    model = resolve_model(args.model or default_model())
    check_checkpoint(model, weights=weights)
    return model


def check_public_ports(args) -> None:
    """The gRPC, HTTP and /metrics ports are free (before any child starts; the front ends
    then share the API ports with SO_REUSEPORT, which would not refuse another server's port),
    and the core link is safe (``headrace.cli.processes.prepare_core_link``). /metrics: the control
    plane's (--metrics-port, served by core 0 of a data-parallel server, the other cores none)
    and serve's data plane children's, every rank of every replica (``serve_children_argvs``:
    replica i's rank r on --dataplane-metrics-port + i x tensor-parallel-size + r), all on
    --metrics-host."""
    from headrace.cli.processes import prepare_core_link
    from headrace.common import net

    prepare_core_link(args)
    net.check_port(f"{args.host}:{args.port}")
    if args.http_port:
        net.check_port(f"{args.host}:{args.http_port}", "--http-port")
    if args.metrics_port:
        net.check_port(f"{args.metrics_host}:{args.metrics_port}", "--metrics-port")
    first = getattr(args, "dataplane_metrics_port", 0)   # serve's children only
    children = getattr(args, "tensor_parallel_size", 1) * getattr(args, "data_parallel_size", 1)
    for k in range(children if first else 0):
        net.check_port(f"{args.metrics_host}:{first + k}", "--dataplane-metrics-port")


def cmd_serve(args) -> int:
    from headrace.cli import data_parallel
    from headrace.cli.configs import placement_of
    from headrace.cli.processes import run_control_plane
    from headrace.cli.supervisor import (EXIT_LOAD_FAILED, DataPlaneChildren, core_watchdog_probe,
                                         health_probe)
    from headrace.common.metrics import enable_multiprocess

    check_speculative_config(args)
    check_structured_outputs_backend(args)
    check_device_name(args.device)
    chunking(args)   # a bad combination of the chunking flags: one line, before any child starts
    placement_of(args)
    lora_modules(args)
    args.model = _model_for_the_control_plane(args, weights=True)
    check_public_ports(args)
    world, dp = args.tensor_parallel_size, args.data_parallel_size
    devices = None
    if dp > 1:   # each replica's GPUs (or a share of one)
        gpus = data_parallel.visible_gpus() if args.device.startswith("cuda") or args.device == "auto" else None
        devices = data_parallel.replica_devices(data_parallel.resolve_auto(args.device, gpus), world, dp, gpus)
        per_gpu = data_parallel.sharing(devices)
        args.gpu_memory_utilization = data_parallel.memory_utilization(args.gpu_memory_utilization, per_gpu)
    sock_dir = tempfile.mkdtemp(prefix="headrace-")
    groups = []
    try:
        name = (lambda i, r: f"dataplane-{r}") if dp == 1 else (lambda i, r: f"dataplane-{i}-{r}")
        listens = [[f"unix:{sock_dir}/{name(i, r)}.sock" for r in range(world)] for i in range(dp)]
        # the children accept only this control plane: a fresh shared secret, passed by environment
        secret_env.resolve(args)   # (flag, else $HEADRACE_WORKER_SECRET, else its _FILE)
        args.worker_secret = args.worker_secret or secrets.token_hex(16)
        env = dataplane_env(args)
        enable_multiprocess(os.path.join(sock_dir, "metrics"))   # the supervisor's metrics too
        from headrace.controlplane.metrics import ControlPlaneMetrics

        metrics = ControlPlaneMetrics()
        cores = data_parallel.core_addresses(args.core_address, sock_dir, dp)   # (as run_control_plane)
        for i in range(dp):
            groups.append(DataPlaneChildren(
                lambda i=i: serve_children_argvs(args, listens[i], devices and devices[i], i), env,
                ready=health_probe(listens[i]), metrics=metrics,
                hung=core_watchdog_probe(cores[i], args.core_ca) if args.step_hang_timeout > 0 else None))
            if devices and data_parallel.sharing(devices) > 1 and i < dp - 1:
                data_parallel.wait_loaded(groups[-1])   # the next sizes its KV from what is left
        failed = run_control_plane(args, _parser(), listens, sock_dir, dict(os.environ),
                                   stop_hook=lambda fn: [g.when_fatal(fn) for g in groups])
        fatal = next((g for g in groups if g.fatal), None)
        if fatal is not None:
            if fatal.exit_status != EXIT_LOAD_FAILED:   # the child did not say why itself
                print(f"headrace serve: {fatal.given_up}", file=sys.stderr)
            return 1
        return 1 if failed else 0
    finally:
        for group in groups:
            group.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def cmd_controlplane(args) -> int:
    from headrace.cli.processes import run_control_plane
    from headrace.common.metrics import enable_multiprocess

    from headrace.cli.configs import placement_of

    check_structured_outputs_backend(args)
    chunking(args)
    lora_modules(args)
    args.model = _model_for_the_control_plane(args, weights=False)
    placement_of(args)
    check_public_ports(args)
    private_dir = tempfile.mkdtemp(prefix="headrace-")
    try:
        enable_multiprocess(os.path.join(private_dir, "metrics"))
        failed = run_control_plane(args, _parser(), args.workers.split(","), private_dir,
                                   dict(os.environ))
        return 1 if failed else 0
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)


def _parser():
    from headrace.cli.options import controlplane_parser

    return controlplane_parser()
