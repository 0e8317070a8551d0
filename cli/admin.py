"""``headrace admin``: a client of a running server's ``headrace.v1.Admin`` service (print or
change the live configuration, drain, resume, reload the model)."""

from __future__ import annotations

import os
import sys

import grpc
from google.protobuf import json_format

from controlplane.policy import POLICIES
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc


def add_admin_parser(sub) -> None:
    p = sub.add_parser("admin", help="read or change a running server's configuration, drain, "
                                     "resume, reload the model (the Admin service)")
    p.add_argument("--address", default="localhost:50051")
    p.add_argument("--token", default=None, help="admin token (default $HEADRACE_ADMIN_TOKEN)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the call")
    ops = p.add_subparsers(dest="admin_command", required=True)
    ops.add_parser("config", help="print the live configuration")
    s = ops.add_parser("set", help="change scheduling settings (from the next step)")
    s.add_argument("--policy", choices=POLICIES)
    s.add_argument("--aging-rate", type=float, help="rank units per second waited (< 0: default)")
    s.add_argument("--max-queue-delay", type=float, help="seconds (0: no guarantee)")
    s.add_argument("--max-running", type=int)
    s.add_argument("--max-batched-tokens", type=int)
    s.add_argument("--max-queued", type=int, help="waiting sequences at most (0: unbounded)")
    d = ops.add_parser("drain", help="stop admitting requests; wait for in-flight ones")
    d.add_argument("--wait", type=float, default=0.0, help="seconds to wait for in-flight requests")
    d.add_argument("--abort", action="store_true", help="then abort what is left")
    ops.add_parser("resume", help="admit requests again")
    r = ops.add_parser("reload", help="reload the model (or load another) on every worker")
    r.add_argument("--model", default="", help="checkpoint directory seen by both planes "
                                               "(default: the current one)")
    r.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take before they are aborted")
    p.set_defaults(func=run_admin_command)


def run_admin_command(args) -> int:
    token = args.token or os.environ.get("HEADRACE_ADMIN_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(args.address) as channel:
        stub = apb_grpc.AdminStub(channel)
        call = dict(metadata=metadata, timeout=args.timeout)
        op = args.admin_command
        try:
            if op == "config":
                out = stub.GetConfig(apb.GetConfigRequest(), **call)
            elif op == "set":
                req = apb.UpdateConfigRequest()
                for field, value in (("policy", args.policy), ("aging_rate", args.aging_rate),
                                     ("max_queue_delay_s", args.max_queue_delay),
                                     ("max_running", args.max_running),
                                     ("max_batched_tokens", args.max_batched_tokens),
                                     ("max_queued", args.max_queued)):
                    if value is not None:
                        setattr(req, field, value)
                out = stub.UpdateConfig(req, **call)
            elif op == "drain":
                out = stub.Drain(apb.DrainRequest(timeout_s=args.wait, abort_remaining=args.abort), **call)
            elif op == "resume":
                out = stub.Resume(apb.ResumeRequest(), **call)
            else:
                out = stub.ReloadModel(apb.ReloadModelRequest(model=args.model,
                                                              drain_timeout_s=args.drain_timeout), **call)
        except grpc.RpcError as exc:
            print(f"headrace admin {op}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(out, always_print_fields_with_no_presence=True))
    return 0
