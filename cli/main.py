"""The ``headrace`` command and its parser: ``serve`` (control plane plus data plane children),
``controlplane`` and ``dataplane`` (each plane alone; the control plane is an engine core and N API
front ends, ``core`` and ``frontend``, which ``headrace.cli.processes`` starts and keeps alive; the
role commands are in ``headrace.cli.roles``), ``generate`` (a streaming client), ``admin`` (the
Admin service: configuration, drain, resume, reload) and ``health`` (a grpc.health.v1 probe for
container health checks).

Only ``dataplane`` imports the data plane (and torch); ``serve`` and ``controlplane`` run the
control plane in a torch-free process and start data planes as ``python -m headrace.cli dataplane``.
A user's mistake (a missing model, a port in use, a bad option) ends the command with one line
on stderr and a non-zero status, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys

from headrace.cli.admin import add_admin_parser
from headrace.cli.client import add_address_args, add_generate_parser
from headrace.cli.options import (CONTROL_PLANE_WORKER_OPTIONS, HelpFormatter,
                                  add_controlplane_args, add_ops_args, add_tls_args,
                                  controlplane_parser, deprecated_alias, positive_int)
from headrace.cli.roles import cmd_core, cmd_dataplane, cmd_frontend, failure_label
from headrace.cli.serve import (_free_port, check_public_ports, cmd_controlplane, cmd_serve,
                                dataplane_argv, dataplane_env, serve_children_argvs)
from headrace.common import secret_env
from headrace.common.logs import configure_logging
from headrace.common.options import (OBSERVABILITY, PARALLEL, SECURITY, SERVER, add_arguments,
                                     add_groups, argument_group)
from headrace.common.worker_options import ParallelOptions, WorkerOptions

def cmd_health(args) -> int:
    """Exit 0 when ``--service`` is SERVING at ``--address``, 1 otherwise (container probes)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from headrace.cli.client import channel

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
        help="the data plane child's /metrics port, rank r on port + r; data-parallel replica i's "
             "rank r on port + i x tensor-parallel-size + r (0 disables)")
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
    par = argument_group(p, PARALLEL)
    par.add_argument("--data-parallel-rank", type=int, default=0,
                     help="which of the server's data-parallel cores this is")
    par.add_argument("--data-parallel-size", type=positive_int, default=1,
                     help="the server's data-parallel cores")
    p.set_defaults(func=cmd_core)

    p = sub.add_parser("frontend", parents=[controlplane_parser()], formatter_class=HelpFormatter,
                       help="one API front end alone (serve and controlplane start them)")
    p.add_argument("--index", type=int, default=0, help="which front end (logs, process list)")
    p.add_argument("--core-address", required=True,
                   help="the engine core: unix:PATH or host:port (comma-separated: the data-parallel cores)")
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
    """Every log line of this process names its role (core, frontend N, dataplane rank r),
    whichever thread writes it."""
    from headrace.common.logs import set_process_fields

    role = {"serve": "supervisor", "controlplane": "supervisor"}.get(args.command, args.command)
    extra = {"frontend": args.index} if args.command == "frontend" else \
        {"rank": args.rank} if args.command == "dataplane" else \
        {"core": args.data_parallel_rank} if args.command == "core" and args.data_parallel_size > 1 else {}
    set_process_fields(role=role, **extra)


def main(argv: list[str] | None = None) -> int:
    from headrace.common.net import PortInUse

    args = build_parser().parse_args(argv)
    if args.command not in ("health", "generate", "admin"):
        # a secret given by flag leaves this process's command line (ps) at once; every
        # secret is then read from its flag, else its environment variable, in one place
        secret_env.scrub_argv(secret_env.flag_values(args))
        configure_logging(getattr(args, "log_format", None))
        bind_role(args)
        from headrace.common import failpoints

        failpoints.warn_if_active()
    try:
        if args.command not in ("health", "generate", "admin"):
            secret_env.resolve(args)   # (a tokens file that cannot be read: one line)
        return args.func(args)
    except (ValueError, PortInUse, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        # a user's mistake (model, port, option, certificate file): one line, no traceback
        print(f"{failure_label(args)}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        # a missing or shadowed module: one line and an exit that ends serve (a data plane's
        # EXIT_LOAD_FAILED, the other roles' usage-error status), never a restart loop
        from headrace.common.import_errors import import_failure
        from headrace.cli.supervisor import EXIT_LOAD_FAILED

        print(f"{failure_label(args)}: {import_failure(exc)}", file=sys.stderr)
        return EXIT_LOAD_FAILED if args.command == "dataplane" else 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
