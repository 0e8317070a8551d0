"""The ``headrace`` command and its parser: ``serve`` (control plane plus data plane children),
``controlplane`` and ``dataplane`` (each plane alone; the control plane is an engine core and N
API front ends, ``core`` and ``frontend``, which ``cli.processes`` starts and keeps alive; the
role commands are in ``cli.roles``), ``generate`` (a streaming client), ``admin`` (the Admin
service: configuration, drain, resume, reload) and ``health`` (a grpc.health.v1 probe for
container health checks).

Only ``dataplane`` imports the data plane (and torch); ``serve`` and ``controlplane`` run the
control plane in a torch-free process and start data planes as ``python -m cli dataplane``.
A user's mistake (a missing model, a port in use, a bad option) ends the command with one line
on stderr and a non-zero status, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import shutil
import sys
import tempfile

from cli.admin import add_admin_parser
from cli.client import add_address_args, add_generate_parser
from cli.options import (
    HelpFormatter,
    add_engine_args,
    add_ops_args,
    add_security_args,
    add_tls_args,
    check_device_name,
    deprecated_alias,
    check_speculative_config,
    check_structured_outputs_backend,
    chunking,
    default_model,
    positive_int,
)
from cli.roles import SUPERVISOR_ENV, cmd_core, cmd_dataplane, cmd_frontend, failure_label
from common import secret_env
from common.logs import configure_logging
from common.options import (
    OBSERVABILITY,
    PARALLEL,
    SECURITY,
    SERVER,
    add_arguments,
    add_groups,
    argument_group,
    from_args,
    to_argv,
)
from common.worker_options import ParallelOptions, WorkerOptions

# what the control plane alone needs of the worker's options (its step limits, the tokenizer)
CONTROL_PLANE_WORKER_OPTIONS = ("model", "max_model_len", "max_num_seqs", "max_batched_tokens")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dataplane_argv(opts: WorkerOptions, par: ParallelOptions, listen: str, metrics_port: int,
                   log_format: str | None = None, metrics_host: str = "127.0.0.1") -> list[str]:
    """The command line of a data plane child process running ``opts`` as rank ``par.rank``."""
    argv = [sys.executable, "-m", "cli", "dataplane", *to_argv(opts), *to_argv(par),
            "--listen", listen, "--metrics-port", str(metrics_port), "--metrics-host", metrics_host]
    return argv + (["--log-format", log_format] if log_format else [])


def serve_children_argvs(args, listens: list[str]) -> list[list[str]]:
    """``headrace serve``'s data plane children: one per rank (``cuda:r`` for rank r under
    tensor parallelism on CUDA), with a fresh rendezvous port each time the group starts."""
    world, opts, metrics = args.tensor_parallel_size, from_args(WorkerOptions, args), args.dataplane_metrics_port
    dist_init = f"tcp://127.0.0.1:{_free_port()}" if world > 1 else None
    argvs = []
    for rank, listen in enumerate(listens):
        rank_opts = opts
        if world > 1 and opts.device.startswith("cuda"):
            rank_opts = dataclasses.replace(opts, device=f"cuda:{rank}")
        argvs.append(dataplane_argv(rank_opts, ParallelOptions(rank, world, dist_init), listen,
                                    metrics + rank if metrics else 0, args.log_format, args.metrics_host))
    return argvs


def dataplane_env(args, environ=os.environ) -> dict:
    """A data plane child's environment: the worker secret (how it accepts only this control
    plane) and no other secret (``common.secret_env``), and the supervisor's name (its
    one-line failures name ``headrace serve``, ``cli.roles.failure_label``)."""
    return dict(secret_env.role_env("dataplane", args, environ), NCCL_NVLS_ENABLE="0",
                **{SUPERVISOR_ENV: "serve"})


def _model_for_the_control_plane(args, weights: bool) -> str:
    """The checkpoint directory (a Hub id resolved), checked for the files serving needs."""
    from common.model_source import check_checkpoint, resolve_model

    model = resolve_model(args.model or default_model())
    check_checkpoint(model, weights=weights)
    return model


def check_public_ports(args) -> None:
    """The gRPC, HTTP and /metrics ports are free (before any child starts; the front ends
    then share the API ports with SO_REUSEPORT, which would not refuse another server's port),
    and the core link is safe (``cli.processes.prepare_core_link``)."""
    from cli.processes import prepare_core_link
    from common import net

    prepare_core_link(args)
    net.check_port(f"{args.host}:{args.port}")
    if args.http_port:
        net.check_port(f"{args.host}:{args.http_port}", "--http-port")
    if args.metrics_port:
        net.check_port(f"{args.metrics_host}:{args.metrics_port}", "--metrics-port")
    first = getattr(args, "dataplane_metrics_port", 0)   # serve's children: rank r on first + r
    for rank in range(getattr(args, "tensor_parallel_size", 1) if first else 0):   # (--metrics-host too)
        net.check_port(f"{args.metrics_host}:{first + rank}", "--dataplane-metrics-port")


def cmd_serve(args) -> int:
    from cli.processes import run_control_plane
    from cli.supervisor import EXIT_LOAD_FAILED, DataPlaneChildren, health_probe
    from common.metrics import enable_multiprocess

    check_speculative_config(args)
    check_structured_outputs_backend(args)
    check_device_name(args.device)
    chunking(args)   # a bad combination of the chunking flags: one line, before any child starts
    args.model = _model_for_the_control_plane(args, weights=True)
    check_public_ports(args)
    world = args.tensor_parallel_size
    sock_dir = tempfile.mkdtemp(prefix="headrace-")
    try:
        listens = [f"unix:{sock_dir}/dataplane-{r}.sock" for r in range(world)]
        # the children accept only this control plane: a fresh shared secret, passed by environment
        secret_env.resolve(args)   # (flag, else $HEADRACE_WORKER_SECRET, else its _FILE)
        args.worker_secret = args.worker_secret or secrets.token_hex(16)
        env = dataplane_env(args)
        enable_multiprocess(os.path.join(sock_dir, "metrics"))   # the supervisor's metrics too
        from controlplane.metrics import ControlPlaneMetrics

        children = DataPlaneChildren(lambda: serve_children_argvs(args, listens), env,
                                     ready=health_probe(listens), metrics=ControlPlaneMetrics())
        try:
            failed = run_control_plane(args, controlplane_parser(), listens, sock_dir, dict(os.environ),
                                       stop_hook=children.when_fatal)
        finally:
            children.stop()
        if children.fatal:
            if children.exit_status != EXIT_LOAD_FAILED:   # the child did not say why itself
                print(f"headrace serve: {children.given_up}", file=sys.stderr)
            return 1
        return 1 if failed else 0
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def cmd_controlplane(args) -> int:
    from cli.processes import run_control_plane
    from common.metrics import enable_multiprocess

    check_structured_outputs_backend(args)
    chunking(args)
    args.model = _model_for_the_control_plane(args, weights=False)
    check_public_ports(args)
    private_dir = tempfile.mkdtemp(prefix="headrace-")
    try:
        enable_multiprocess(os.path.join(private_dir, "metrics"))
        failed = run_control_plane(args, controlplane_parser(), args.workers.split(","), private_dir,
                                   dict(os.environ))
        return 1 if failed else 0
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)


def cmd_health(args) -> int:
    """Exit 0 when ``--service`` is SERVING at ``--address``, 1 otherwise (container probes)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from cli.client import channel

    address, chan = channel(args)
    try:
        with chan:
            status = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}", file=sys.stderr)
        return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{address} {args.service or '(server)'}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


DESCRIPTION = """headrace serves LLMs over gRPC with a separated control plane and data plane.
'headrace serve' runs both (the data plane as a child process); 'controlplane' and
'dataplane' run one plane alone; 'generate', 'admin' and 'health' talk to a running server."""


def _add_workers(p: argparse.ArgumentParser) -> None:
    argument_group(p, SERVER).add_argument(
        "--workers", default=os.environ.get("HEADRACE_WORKERS"), required=not os.environ.get("HEADRACE_WORKERS"),
        help="comma-separated data plane addresses (default $HEADRACE_WORKERS)")


def add_controlplane_args(p: argparse.ArgumentParser, supervisor: bool = False) -> None:
    """What the engine core and the front ends take (serve and controlplane forward them)."""
    add_engine_args(p)
    add_ops_args(p, 9400, control=True)
    add_security_args(p)
    if supervisor:   # serve, controlplane
        net = argument_group(p, SERVER)
        net.add_argument("--api-server-count", type=positive_int, default=None,
                         help="API front-end processes sharing the public ports (default: 1 below "
                              "4 CPU cores, else min(4, cores // 2))")
        net.add_argument("--core-address", default=None,
                         help="where the engine core serves its front ends (default: a unix socket "
                              "in the server's private directory; host:port for TCP)")


def controlplane_parser() -> argparse.ArgumentParser:
    """The options the core and front-end processes share (the parent of their parsers)."""
    p = argparse.ArgumentParser(add_help=False, prog="headrace-controlplane")
    add_arguments(p, WorkerOptions, only=CONTROL_PLANE_WORKER_OPTIONS)
    add_controlplane_args(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace", description=DESCRIPTION,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, usage: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter,
                              usage=usage)

    many = "%(prog)s [options]   (options by topic below)"   # usage of the servers' commands

    p = command("serve", "serve a model: an engine core, API front ends and data plane child "
                         "processes", many)
    add_groups(p)
    add_arguments(p, WorkerOptions)
    add_controlplane_args(p, supervisor=True)
    argument_group(p, OBSERVABILITY).add_argument(
        "--dataplane-metrics-port", type=int, default=9401,
        help="the data plane child's /metrics port, rank r on port + r (0 disables)")
    argument_group(p, PARALLEL).add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="data plane processes (ranks) sharing the model; cuda:r for rank r")
    p.set_defaults(func=cmd_serve)

    p = command("controlplane", "run the control plane alone (an engine core and API front ends)", many)
    add_groups(p)
    add_arguments(p, WorkerOptions, only=CONTROL_PLANE_WORKER_OPTIONS)
    add_controlplane_args(p, supervisor=True)
    _add_workers(p)
    p.set_defaults(func=cmd_controlplane)

    p = sub.add_parser("core", parents=[controlplane_parser()], formatter_class=HelpFormatter,
                       help="the engine core alone (serve and controlplane start it)")
    _add_workers(p)
    p.add_argument("--core-address", required=True, help="where front ends connect: unix:PATH or host:port")
    p.set_defaults(func=cmd_core)

    p = sub.add_parser("frontend", parents=[controlplane_parser()], formatter_class=HelpFormatter,
                       help="one API front end alone (serve and controlplane start them)")
    p.add_argument("--index", type=int, default=0, help="which front end (logs, process list)")
    p.add_argument("--core-address", required=True, help="the engine core: unix:PATH or host:port")
    p.set_defaults(func=cmd_frontend)

    p = command("dataplane", "run one data plane worker alone", many)
    add_groups(p)
    add_arguments(p, WorkerOptions)
    add_arguments(p, ParallelOptions)
    argument_group(p, SERVER).add_argument(
        "--listen", default="127.0.0.1:50061", help="host:port or unix:/path to serve the step protocol on")
    add_ops_args(p, 9401, control=False)
    argument_group(p, OBSERVABILITY).add_argument(
        "--metrics-host", default="127.0.0.1",
        help="interface of /metrics (no authentication): 127.0.0.1 whatever --listen is; "
             "0.0.0.0 for a Prometheus on another machine")
    add_tls_args(p)
    argument_group(p, SECURITY).add_argument(
        "--worker-secret", default=None,
        help="serve only callers presenting this shared secret (default $HEADRACE_WORKER_SECRET, "
             "else the file $HEADRACE_WORKER_SECRET_FILE names; prefer them: a flag is visible "
             "in ps until the process starts)")
    deprecated_alias(p, "--secret", "--worker-secret", dest="worker_secret")
    p.set_defaults(func=cmd_dataplane)

    add_generate_parser(command("generate", "stream a completion from a running server"))
    add_admin_parser(sub, HelpFormatter)

    p = command("health", "check a server's grpc.health.v1 status (exit 0 when SERVING)")
    add_address_args(p)
    p.add_argument("--service", default="", help="service name (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.set_defaults(func=cmd_health)

    return parser


def bind_role(args) -> None:
    """Every log line of this process names its role (core, frontend N, dataplane rank r)."""
    import structlog

    role = {"serve": "supervisor", "controlplane": "supervisor"}.get(args.command, args.command)
    extra = {"frontend": args.index} if args.command == "frontend" else \
        {"rank": args.rank} if args.command == "dataplane" else {}
    structlog.contextvars.bind_contextvars(role=role, **extra)


def main(argv: list[str] | None = None) -> int:
    from common.net import PortInUse

    args = build_parser().parse_args(argv)
    if args.command not in ("health", "generate", "admin"):
        # a secret given by flag leaves this process's command line (ps) at once; every
        # secret is then read from its flag, else its environment variable, in one place
        secret_env.scrub_argv(secret_env.flag_values(args))
        configure_logging(getattr(args, "log_format", None))
        bind_role(args)
    try:
        if args.command not in ("health", "generate", "admin"):
            secret_env.resolve(args)   # (a tokens file that cannot be read: one line)
        return args.func(args)
    except (ValueError, PortInUse, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        # a user's mistake (model, port, option, certificate file): one line, no traceback
        print(f"{failure_label(args)}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
