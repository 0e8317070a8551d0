"""``headrace generate``: streams a completion from a running server through the client library
(``headrace.client``), with the server's connection options (address, API token, TLS, the
``HEADRACE_*`` variables), a short connect timeout that names the server's state (down,
loading, draining), the API's sampling defaults, and a quiet exit on Ctrl-C."""

from __future__ import annotations

import argparse
import sys

from headrace.cli.options import deprecated_alias

# as /v1/completions (OpenAI's default): a first try prints a line, not the whole context
DEFAULT_MAX_TOKENS = 16

# option -> GenerateRequest field; unset options take the server's defaults (see the API)
SAMPLING = (("max_tokens", int, f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}, as the "
                                "HTTP API's completions; the gRPC API's own default is up to "
                                "max_model_len)"),
            ("temperature", float, "sampling temperature, 0 = greedy (default: the server's, 1.0)"),
            ("top_p", float, "nucleus sampling mass in (0, 1] (default: the server's, 1.0 = off)"),
            ("top_k", int, "sample from the k most likely tokens (default: the server's, 0 = off)"),
            ("min_p", float, "drop tokens below min_p x the top probability (default: 0 = off)"),
            ("repetition_penalty", float, "penalty on tokens already seen (default: 1.0 = off)"),
            ("seed", int, "makes the completion reproducible (default: none)"))


def add_generate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    for name, kind, help in SAMPLING:
        p.add_argument("--" + name.replace("_", "-"), type=kind,
                       default=DEFAULT_MAX_TOKENS if name == "max_tokens" else None, help=help)
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, not returned (repeat for several)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--model", default=None,
                   help="a LoRA adapter the server serves, by name (default: the base model; docs/lora.md)")
    shape = p.add_mutually_exclusive_group()   # structured outputs (docs/structured_outputs.md)
    shape.add_argument("--json-schema", default=None,
                       help="the output is JSON valid against this schema (its JSON text, or @FILE)")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", default=None, help="the output matches this regular expression")
    shape.add_argument("--choice", action="append", default=None,
                       help="the output is one of these strings (repeat for each)")
    shape.add_argument("--grammar", default=None, help="the output follows this GBNF grammar (or @FILE)")
    add_address_args(p)
    p.add_argument("--api-token", default=None,
                   help="bearer token of a server started with --api-token (default $HEADRACE_API_TOKEN)")
    p.add_argument("--connect-timeout", type=float, default=None,
                   help="seconds to wait for the server to be ready (default $HEADRACE_CONNECT_TIMEOUT, else 5)")
    p.add_argument("--session-id", default=None,
                   help="affinity key sent as x-session-id: a load balancer in front of several "
                        "servers keeps a session on one (default $HEADRACE_SESSION_ID)")
    deprecated_alias(p, "--wait", "--connect-timeout", dest="connect_timeout", type=float)
    p.set_defaults(func=run_generate)


def add_address_args(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """--address and the TLS options every command that talks to a server takes (the client
    library's, with the same ``HEADRACE_*`` variables). ``suppress``: no defaults, for the copy
    of them on a subcommand (so they may come before or after it)."""
    default = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--address", default=default(None),
                   help="the server, host:port (default $HEADRACE_ADDRESS, else localhost:50051)")
    p.add_argument("--tls", action="store_true", default=default(False),
                   help="connect with TLS, verifying the server with the system's CAs")
    p.add_argument("--tls-ca", default=default(None),
                   help="connect with TLS, verifying the server with this CA (default $HEADRACE_TLS_CA)")
    p.add_argument("--tls-cert", default=default(None),
                   help="client certificate for mutual TLS (default $HEADRACE_TLS_CERT)")
    p.add_argument("--tls-key", default=default(None), help="its private key (default $HEADRACE_TLS_KEY)")


def channel(args):
    """A gRPC channel to ``args.address`` with the TLS options of ``add_address_args``; raises
    SystemExit with one line when they are inconsistent (a certificate without its key, a
    missing file)."""
    from headrace.client.connection import ConnectionOptions

    try:
        opts = ConnectionOptions.resolve(args.address, tls=args.tls, tls_ca=args.tls_ca,
                                         tls_cert=args.tls_cert, tls_key=args.tls_key)
    except ValueError as exc:
        raise SystemExit(f"headrace: {exc}") from None
    return opts.address, opts.channel()


def run_generate(args) -> int:
    from headrace.client import Client, HeadraceError

    params = {name: getattr(args, name) for name, _, _ in SAMPLING if getattr(args, name) is not None}
    if args.stop:
        params["stop"] = args.stop
    if args.ignore_eos:
        params["ignore_eos"] = True
    if args.model:
        params["model"] = args.model
    params.update(_structured(args))
    last = "\n"   # the last character written to stdout
    try:
        with Client(args.address, api_token=args.api_token, tls=args.tls, tls_ca=args.tls_ca,
                    tls_cert=args.tls_cert, tls_key=args.tls_key,
                    connect_timeout=args.connect_timeout, session_id=args.session_id) as client:
            for chunk in client.stream(args.prompt, **params):
                if chunk.text:
                    last = chunk.text[-1]   # first: Ctrl-C may come during the write
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                if chunk.finish_reason:
                    last = _newline(last)
                    print(f"[{chunk.finish_reason}: {chunk.usage.completion_tokens} tokens]", file=sys.stderr)
    except KeyboardInterrupt:
        _newline(last)
        return 130
    except HeadraceError as exc:
        _newline(last)
        print(f"headrace generate: {exc}", file=sys.stderr)
        return 1
    _newline(last)
    return 0


def _structured(args) -> dict:
    """The structured-output constraint given (``--json-schema`` and ``--grammar`` take @FILE)."""
    def text(value: str) -> str:
        if not value.startswith("@"):
            return value
        try:
            with open(value[1:], encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise SystemExit(f"headrace generate: cannot read {value[1:]}: {exc.strerror}") from None

    if args.json_schema is not None:
        return {"json_schema": text(args.json_schema)}
    if args.grammar is not None:
        return {"grammar": text(args.grammar)}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    return {"json_object": True} if args.json_object else {}


def _newline(last: str) -> str:
    """Ends stdout's line (so a shell prompt starts on its own line)."""
    if last != "\n":
        sys.stdout.write("\n")
        sys.stdout.flush()
    return "\n"
