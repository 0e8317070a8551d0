"""``headrace admin``: a client of a running server's ``headrace.v1.Admin`` service (print or
change the live configuration, drain, resume, reload the model, record a profile, load and
unload LoRA adapters)."""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from google.protobuf import json_format

from headrace.cli.client import add_address_args, channel
from headrace.cli.options import deprecated_alias, positive_int
from headrace.controlplane.scheduling.policy import POLICIES
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc


def _connection_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    """--address and TLS/--api-token/--timeout: on ``admin`` with their defaults, and again on
    each subcommand without (so they may come before or after it). The token flag is spelled
    as on every other command (``--token`` still works, hidden)."""
    value = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    add_address_args(p, suppress=not defaults)
    p.add_argument("--api-token", default=value(None),
                   help="the server's admin token, sent as 'authorization: Bearer' (default "
                        "$HEADRACE_ADMIN_TOKEN)")
    deprecated_alias(p, "--token", "--api-token", dest="api_token")
    p.add_argument("--timeout", type=float, default=value(3600.0), help="seconds to wait for the call")


def add_admin_parser(sub, formatter_class=argparse.HelpFormatter) -> None:
    text = ("read or change a running server's configuration, drain, resume, reload the model, "
            "record a profile (the Admin service)")
    p = sub.add_parser("admin", help=text, description=text, formatter_class=formatter_class)
    _connection_args(p, defaults=True)
    ops = p.add_subparsers(dest="admin_command", required=True)
    connection = argparse.ArgumentParser(add_help=False)
    _connection_args(connection, defaults=False)

    def op(name: str, help: str) -> argparse.ArgumentParser:
        return ops.add_parser(name, help=help, description=help, parents=[connection],
                              formatter_class=formatter_class)

    op("config", "print the live configuration")
    s = op("set", "change scheduling settings (from the next step)")
    s.add_argument("--policy", choices=POLICIES, help="scheduling policy (unset: unchanged)")
    s.add_argument("--aging-rate", type=float, help="rank units per second waited (< 0: default)")
    s.add_argument("--max-queue-delay", type=float, help="seconds (0: no guarantee)")
    s.add_argument("--max-running", "--max-num-seqs", type=int, dest="max_running",
                   help="sequences per step at most (unset: unchanged)")
    s.add_argument("--max-batched-tokens", type=int, help="tokens per step at most (unset: unchanged)")
    s.add_argument("--max-queued", type=int, help="waiting sequences at most (0: unbounded)")
    d = op("drain", "stop admitting requests; wait for in-flight ones")
    d.add_argument("--wait", type=float, default=0.0, help="seconds to wait for in-flight requests")
    d.add_argument("--abort", action="store_true", help="then abort what is left")
    op("resume", "admit requests again")
    r = op("reload", "reload the model (or load another) on every worker")
    r.add_argument("--model", default="", help="checkpoint directory seen by both planes "
                                               "(default: the current one)")
    r.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take before they are aborted")
    f = op("profile", "record the next N engine steps: a torch.profiler trace per data plane rank "
                      "(Chrome trace JSON for Perfetto or TensorBoard) and the engine core's cProfile")
    f.add_argument("--steps", type=positive_int, default=20, help="engine steps to record")
    f.add_argument("--dir", required=True,
                   help="directory for the files, on the server's machine(s); a relative one is "
                        "taken from this shell's directory (docs/operations.md, Profiling)")
    f.add_argument("--wait", type=float, default=300.0,
                   help="seconds to wait for the steps (the server must be busy meanwhile); then "
                        "it stops with what was recorded")
    lo = op("load-lora", "serve a PEFT LoRA adapter under a name (needs --enable-lora; docs/lora.md)")
    lo.add_argument("name", help="the name requests give as their model")
    lo.add_argument("path", help="the adapter's directory, as the data planes see it")
    un = op("unload-lora", "stop serving a LoRA adapter (new requests for it are refused at once)")
    un.add_argument("name")
    un.add_argument("--wait", type=float, default=30.0,
                    help="seconds to wait for the requests still using it (0: refuse if in use)")
    op("loras", "list the LoRA adapters served, with their running and waiting sequences")
    p.set_defaults(func=run_admin_command)


def run_admin_command(args) -> int:
    token = args.api_token or os.environ.get("HEADRACE_ADMIN_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    _, chan = channel(args)
    with chan:
        stub = apb_grpc.AdminStub(chan)
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
            elif op == "load-lora":
                out = stub.LoadLoraAdapter(apb.LoadLoraAdapterRequest(lora_name=args.name,
                                                                      lora_path=args.path), **call)
            elif op == "unload-lora":
                out = stub.UnloadLoraAdapter(apb.UnloadLoraAdapterRequest(lora_name=args.name,
                                                                          wait_s=args.wait), **call)
            elif op == "loras":
                out = stub.ListLoraAdapters(apb.ListLoraAdaptersRequest(), **call)
            elif op == "profile":
                stub.StartProfile(apb.StartProfileRequest(dir=os.path.abspath(args.dir),
                                                          num_steps=args.steps), **call)
                out = stub.StopProfile(apb.StopProfileRequest(wait_s=args.wait), **call)
            else:
                out = stub.ReloadModel(apb.ReloadModelRequest(model=args.model,
                                                              drain_timeout_s=args.drain_timeout), **call)
        except grpc.RpcError as exc:
            print(f"headrace admin {op}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(json_format.MessageToJson(out, always_print_fields_with_no_presence=True))
    if op == "profile" and (out.errors or not out.files):   # the reasons are in the JSON too
        print(f"headrace admin profile: {'; '.join(out.errors) or 'no file was written'}", file=sys.stderr)
        return 1
    return 0
