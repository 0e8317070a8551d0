"""The ``headrace`` command line's options: the options the commands share (engine, TLS and
security, operations, the public APIs); ``headrace.cli.configs`` builds the configuration objects.
The worker's options are generated from ``headrace.common.worker_options``
(``headrace.common.options.add_arguments``). Each option is listed in ``--help`` under one heading
(``headrace.common.options.GROUPS``): an option added here goes through ``argument_group(p,
HEADING)``."""

from __future__ import annotations

import argparse
import os
import re
import sys

from headrace.common.logs import LOG_FORMATS
from headrace.common.options import (MODEL, OBSERVABILITY, PARALLEL, SCHEDULING, SECURITY, SERVER,
                                     add_arguments, argument_group)
from headrace.controlplane.scheduling.chunking import (DEFAULT_MAX_LONG_PARTIAL_PREFILLS,
                                                       DEFAULT_MAX_NUM_PARTIAL_PREFILLS,
                                                       DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES)
from headrace.controlplane.frontend import placement
from headrace.controlplane.http.timeouts import DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT
from headrace.controlplane.requests.limits import DEFAULT_MAX_N, DEFAULT_MAX_PROMPTS, QUEUE_PER_SLOT
from headrace.controlplane.scheduling.policy import POLICIES
from headrace.controlplane.structured.backends import BACKENDS
from headrace.controlplane.kv.tier_cost import POLICIES as POLICIES_TIER
from headrace.common.worker_options import WorkerOptions


def default_model() -> str:
    """$HEADRACE_MODEL (containers), else the embedded tiny model. Only its path is read: the
    ``headrace.dataplane.default_model`` package imports neither torch nor the rest of the data
    plane."""
    if os.environ.get("HEADRACE_MODEL"):
        return os.environ["HEADRACE_MODEL"]
    from headrace.dataplane.default_model import default_model_dir

    return str(default_model_dir())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help shows its default, unless it says it itself or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, False, "", argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(device: str) -> None:
    """ValueError unless ``device`` is auto, cpu, cuda or cuda:N (whether that GPU exists, and
    what auto picks, is the data plane's business: the control plane's process has no torch)."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"--device {device}: not a device; use auto, cpu, cuda or cuda:N")


class _DeprecatedAlias(argparse.Action):
    """A renamed option's old spelling: parsed as the new one, hidden from ``--help``, and
    named on stderr (one line) when used."""

    def __init__(self, option_strings, dest, renamed_to: str, **kwargs):
        self.renamed_to = renamed_to
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"headrace: {option_string} is deprecated; use {self.renamed_to}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(p, alias: str, renamed_to: str, dest: str, **kwargs) -> None:
    """``alias`` keeps working as ``renamed_to`` (into ``dest``) without showing in ``--help``."""
    p.add_argument(alias, action=_DeprecatedAlias, renamed_to=renamed_to, dest=dest, **kwargs)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's options (its step limits, ``--max-num-seqs`` and
    ``--max-batched-tokens``, are the worker options of that name)."""
    parser, net = p, argument_group(p, SERVER)
    net.add_argument("--host", default="127.0.0.1",
                     help="interface of the APIs (gRPC and HTTP): 127.0.0.1 serves this machine "
                          "only, 0.0.0.0 every interface (then protect it with --api-token and TLS)")
    net.add_argument("--port", type=int, default=50051, help="port of the gRPC API")
    p = argument_group(p, SCHEDULING)
    p.add_argument("--policy", choices=POLICIES, default="fifo", help="scheduling policy")
    p.add_argument("--aging-rate", type=float, default=None,
                   help="rank units a second of waiting is worth (default per policy)")
    p.add_argument("--max-queue-delay", type=float, default=None,
                   help="seconds after which a waiting request is admitted ahead of the policy order")
    p.add_argument("--max-prefill-tokens-with-decodes", type=positive_int,
                   default=DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES,
                   help="prompt tokens a step that carries decodes may compute at most (their "
                        "inter-token latency budget, in tokens; a step without decodes fills "
                        "--max-batched-tokens; docs/scheduling.md)")
    p.add_argument("--max-num-partial-prefills", type=positive_int,
                   default=DEFAULT_MAX_NUM_PARTIAL_PREFILLS,
                   help="prefills that share a step's prompt budget fairly (vLLM's name)")
    p.add_argument("--max-long-partial-prefills", type=positive_int,
                   default=DEFAULT_MAX_LONG_PARTIAL_PREFILLS,
                   help="long prefills served before short ones at most; shorter prompts pass "
                        "the others (vLLM's name; <= --max-num-partial-prefills)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="a prefill with more tokens left is long, and no prefill computes more "
                        "in one step (vLLM's name; 0: no cap, long above an even share of "
                        "--max-prefill-tokens-with-decodes)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable automatic prefix caching")
    p.add_argument("--watermark", type=float, default=0.01,
                   help="fraction of KV blocks that admission leaves free for running requests")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                   help="a preempted request's KV: recompute it when resumed (default), or swap "
                        "it to the host KV tier and back (needs --kv-offloading-size)")
    p.add_argument("--kv-offloading-policy", choices=POLICIES_TIER, default="auto",
                   help="prefix hits found in the host KV tier: auto loads them where copying "
                        "them to the device is cheaper than recomputing them (the data plane's "
                        "measured copy rate against its measured prefill cost), always loads "
                        "them, never recomputes them; off leaves the data planes' host tiers "
                        "unused")
    p.add_argument("--no-fair-share", action="store_true",
                   help="no fair share of running slots and KV blocks between tenants "
                        "(docs/scheduling.md)")
    argument_group(parser, MODEL).add_argument(
        "--structured-outputs-backend", choices=BACKENDS, default="auto",
        help="grammar engine of structured outputs (JSON schema, regex, choice, grammar): "
             "guidance (llguidance, torch-free), xgrammar (imports torch into the engine core), "
             "auto: guidance if installed, else xgrammar (docs/structured_outputs.md)")
    argument_group(parser, MODEL).add_argument(
        "--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under these names: a request's model "
             "(OpenAI) or model field (gRPC) selects one; also vLLM's JSON form "
             '\'{"name": NAME, "path": PATH}\'; needs --enable-lora (docs/lora.md)')
    p.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                   help="sequences a request may ask for at most: its parallel samples (n) times "
                        f"its prompts (default {DEFAULT_MAX_N})")
    p.add_argument("--max-prompts-per-request", type=positive_int, default=DEFAULT_MAX_PROMPTS,
                   help="prompts one HTTP completions body may list at most (more: HTTP 400; "
                        f"default {DEFAULT_MAX_PROMPTS})")


def add_data_parallel_args(p: argparse.ArgumentParser, supervisor: bool) -> None:
    """``--data-parallel-size`` (serve, controlplane) and how the front ends place requests on the
    cores (forwarded to them; ``headrace.controlplane.frontend.placement``), under the parallelism
    heading."""
    p = argument_group(p, PARALLEL)
    if supervisor:
        p.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                       help="engine cores, each with its own data plane group (its GPUs, a share "
                            "of one, or the CPU), behind the same API front ends (docs/scaling.md)")
    p.add_argument("--data-parallel-placement", choices=placement.POLICIES, default="prefix",
                   help="which core a request goes to: prefix (the one caching the longest prefix "
                        "of the prompt, unless much busier than the least loaded), least-load, "
                        "round-robin")
    p.add_argument("--data-parallel-balance-threshold", type=int, default=32,
                   help="prefix placement passes over a core with this many more sequences "
                        "than the least loaded one (and --data-parallel-balance-ratio times as many)")
    p.add_argument("--data-parallel-balance-ratio", type=float, default=1.5,
                   help="see --data-parallel-balance-threshold")


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p = argument_group(p, SECURITY)
    p.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", default=None,
                   help="require client certificates signed by this CA (mutual TLS)")


def add_security_args(p: argparse.ArgumentParser) -> None:
    add_tls_args(p)
    p = argument_group(p, SECURITY)
    p.add_argument("--api-token", action="append", default=None, metavar="[TENANT=]TOKEN",
                   help="require 'authorization: Bearer TOKEN' on the public API; repeat for "
                        "several tokens, each naming its tenant (default $HEADRACE_API_TOKENS, "
                        "comma-separated, and $HEADRACE_API_TOKEN; a flag is visible in ps until "
                        "the process starts: prefer the variables or --api-tokens-file)")
    p.add_argument("--api-tokens-file", default=None,
                   help="a file of [TENANT=]TOKEN lines, beside or instead of --api-token")
    p.add_argument("--trust-tenant-header", action="store_true",
                   help="take the tenant from the x-headrace-tenant header (only behind a "
                        "gateway that sets it)")
    p.add_argument("--worker-secret", default=None,
                   help="shared secret presented to the data planes (default $HEADRACE_WORKER_SECRET, "
                        "else the file $HEADRACE_WORKER_SECRET_FILE names)")
    p.add_argument("--worker-ca", default=None, help="verify the data planes' TLS certificates with this CA")
    p.add_argument("--worker-cert", default=None, help="client certificate for data planes with mutual TLS")
    p.add_argument("--worker-key", default=None, help="its private key")
    p.add_argument("--core-tls-cert", default=None,
                   help="the engine core serves a TCP --core-address with TLS, this certificate (PEM)")
    p.add_argument("--core-tls-key", default=None, help="its private key")
    p.add_argument("--core-ca", default=None,
                   help="front ends verify a TCP engine core's certificate with this CA (PEM)")
    p.add_argument("--core-secret", default=None,
                   help="shared secret of the engine core and its front ends (default "
                        "$HEADRACE_CORE_SECRET; serve and controlplane make a fresh one)")


def add_ops_args(p: argparse.ArgumentParser, metrics_port: int, control: bool) -> None:
    ops, sched, sec = (argument_group(p, title) for title in (OBSERVABILITY, SCHEDULING, SECURITY))
    ops.add_argument("--metrics-port", type=int, default=metrics_port,
                     help=f"Prometheus /metrics HTTP port (0 disables; default {metrics_port}); "
                          "a port in use fails start-up")
    ops.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                     help="json or console (default: console on a terminal, json otherwise)")
    if control:
        ops.add_argument("--metrics-host", default="127.0.0.1",
                         help="interface of /metrics, both planes' (no authentication): 127.0.0.1 "
                              "whatever --host is; 0.0.0.0 for a Prometheus on another machine")
        parser, p = p, sched
        p.add_argument("--max-queued", type=int, default=None,
                       help="waiting sequences at most; beyond, RESOURCE_EXHAUSTED (HTTP 429) "
                            f"(default {QUEUE_PER_SLOT} x --max-num-seqs; 0: unbounded)")
        p.add_argument("--outage-deadline", type=float, default=60.0,
                       help="seconds requests wait for a lost data plane (or one whose steps keep "
                            "failing) before UNAVAILABLE")
        p.add_argument("--step-timeout-floor", type=float, default=5.0,
                       help="seconds a step may go unanswered, if also far longer than any step of "
                            "its size, before the data plane is checked; one that does not answer "
                            "then makes the server NOT_SERVING (default 5)")
        p.add_argument("--step-hang-timeout", type=float, default=60.0,
                       help="seconds a data plane may stay unanswering before it counts as hung: "
                            "serve kills and restarts it, requests resume by recompute (default 60; "
                            "0: never)")
        p.add_argument("--drain-timeout", type=float, default=10.0,
                       help="on SIGTERM/SIGINT: seconds open streams may take to finish before each "
                            "ends with an error (a second SIGINT exits at once; default 10)")
        p.add_argument("--stream-interval", type=positive_int, default=1,
                       help="tokens per streamed message at least, for requests that do not set "
                            "stream_interval, after the first token, which goes out at once "
                            "(default 1: every token as it is sampled)")
        p.add_argument("--pipeline-depth", type=positive_int, default=3,
                       help="steps in flight (default 3: the data plane always holds the next "
                            "step; 2 while a running request has stop strings)")
        p.add_argument("--no-overlap", action="store_true",
                       help="one step in flight (no overlapped scheduling)")
        sec.add_argument("--admin-token", default=None,
                         help="bearer token for the Admin service (default $HEADRACE_ADMIN_TOKEN; "
                              "without one, Admin is disabled; visible in ps until the process "
                              "starts: prefer the variable)")
        sec.add_argument("--admin-insecure-loopback", action="store_true",
                         help="without an admin token, serve Admin to every caller on the loopback "
                              "interface of a server bound to loopback (any local user or proxy)")
        sec.add_argument("--model-root", action="append", default=None, metavar="DIR",
                         help="Admin's ReloadModel loads models from under this directory only; "
                              "repeatable (default: the directory holding --model, and the Hugging "
                              "Face cache)")
        ops.add_argument("--log-prompts", action="store_true", help="log prompt text (off by default)")
        ops.add_argument("--disable-log-requests", action="store_true",
                         help="no log line per finished request")
        add_api_args(parser)


def add_api_args(p: argparse.ArgumentParser) -> None:
    """The public APIs beside gRPC: OpenAI-compatible HTTP, chat templates, sampling defaults."""
    net = argument_group(p, SERVER)
    net.add_argument("--http-port", type=int, default=8000,
                     help="OpenAI-compatible HTTP API port on the gRPC host (0 disables; default 8000)")
    net.add_argument("--http-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                     help="seconds a request's HTTP headers may take to arrive; then the "
                          "connection is closed (slow clients)")
    net.add_argument("--http-keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT,
                     help="seconds an idle HTTP keep-alive connection stays open")
    p = argument_group(p, MODEL)
    p.add_argument("--chat-template", default=None,
                   help="jinja chat template file (default: the model's own)")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto: the model's generation_config.json sets default sampling "
                        "parameters; vllm: ignore it")


# what the control plane alone needs of the worker's options (its step limits, the tokenizer)
CONTROL_PLANE_WORKER_OPTIONS = ("model", "max_model_len", "max_num_seqs", "max_batched_tokens",
                                "deterministic")


def add_controlplane_args(p: argparse.ArgumentParser, supervisor: bool = False) -> None:
    """What the engine core and the front ends take (serve and controlplane forward them)."""
    add_engine_args(p)
    add_ops_args(p, 9400, control=True)
    add_security_args(p)
    add_data_parallel_args(p, supervisor)
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
