"""The configuration objects the ``headrace`` commands build from their parsed options
(``headrace.cli.options`` declares the options): the control plane's keyword options, the engine
core link's security, prefill chunking, the engine's configuration and the front ends' placement,
and the checks that stop a command with one line before any process starts."""

from __future__ import annotations

import re

from headrace.controlplane.frontend import placement
from headrace.controlplane.scheduling.chunking import Chunking
from headrace.controlplane.engine.loop import EngineConfig
from headrace.controlplane.scheduling.policy import Policy


def placement_of(args) -> "placement.Placement":
    """The front ends' placement (ValueError for bad thresholds)."""
    if args.data_parallel_balance_threshold < 0 or args.data_parallel_balance_ratio < 1:
        raise ValueError("--data-parallel-balance-threshold must be >= 0 and "
                         "--data-parallel-balance-ratio >= 1")
    return placement.Placement(args.data_parallel_placement, args.data_parallel_balance_threshold,
                               args.data_parallel_balance_ratio)


def plane_options(args) -> dict:
    """ControlPlane keyword options from the command line (secrets: its flags, else the
    environment, ``headrace.common.secret_env``)."""
    from headrace.common import secret_env, security

    secret_env.resolve(args)
    return dict(metrics_port=args.metrics_port or None, metrics_host=args.metrics_host,
                admin_token=args.admin_token,
                log_requests=not args.disable_log_requests, log_prompts=args.log_prompts,
                api_token=security.ApiTokens(args.api_token or ()),
                trust_tenant_header=args.trust_tenant_header, max_n=args.max_n,
                max_prompts=args.max_prompts_per_request,
                tls=security.server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca),
                worker_credentials=security.channel_credentials(args.worker_ca, args.worker_cert,
                                                                args.worker_key),
                worker_secret=args.worker_secret,
                http_port=args.http_port or None, chat_template=args.chat_template,
                generation_config=args.generation_config,
                http_tls=(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
                http_timeouts=(args.http_header_timeout, args.http_keep_alive_timeout),
                admin_insecure_loopback=args.admin_insecure_loopback, model_roots=args.model_root)


def core_link_options(args, side: str) -> dict:
    """The link's security for the engine core (``side="core"``: TLS server credentials) or a
    front end (``"frontend"``: the CA to verify the core with), and the shared secret."""
    from headrace.common import secret_env, security

    secret_env.resolve(args)
    secret = args.core_secret
    if side == "core":
        return dict(core_secret=secret,
                    core_tls=security.server_credentials(args.core_tls_cert, args.core_tls_key))
    return dict(core_secret=secret, core_credentials=security.channel_credentials(args.core_ca))


def chunking(args) -> Chunking:
    """The prefill chunking options (ValueError naming the flag when they do not fit)."""
    try:
        return Chunking(args.max_prefill_tokens_with_decodes, args.max_num_partial_prefills,
                        args.max_long_partial_prefills, args.long_prefill_token_threshold)
    except ValueError as exc:   # the fields' names as the flags' names
        raise ValueError(re.sub(r"\b[a-z]+(?:_[a-z]+)+\b", lambda m: "--" + m[0].replace("_", "-"),
                                str(exc))) from None


def engine_config(args) -> EngineConfig:
    return EngineConfig(max_running=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                        max_model_len=getattr(args, "max_model_len", None),
                        policy=Policy(args.policy, args.aging_rate, args.max_queue_delay),
                        chunking=chunking(args),
                        enable_prefix_cache=not args.no_prefix_cache, watermark=args.watermark,
                        max_queued=args.max_queued, outage_deadline_s=args.outage_deadline,
                        step_timeout_floor_s=args.step_timeout_floor,
                        step_hang_timeout_s=args.step_hang_timeout,
                        fair_share=not args.no_fair_share,
                        pipeline_depth=1 if args.no_overlap else args.pipeline_depth,
                        stream_interval=args.stream_interval,
                        preemption_mode=args.preemption_mode,
                        kv_offloading_policy=args.kv_offloading_policy,
                        structured_outputs_backend=args.structured_outputs_backend,
                        lora_modules=lora_modules(args),
                        deterministic=getattr(args, "deterministic", False))


def lora_modules(args) -> list[tuple[str, str]]:
    """``--lora-modules`` as (name, path) pairs (ValueError naming a malformed entry, or the
    flag used where the data planes are started without ``--enable-lora``)."""
    from headrace.controlplane.lora.registry import parse_modules

    modules = parse_modules(getattr(args, "lora_modules", None))
    if modules and getattr(args, "enable_lora", True) is False:
        raise ValueError("--lora-modules needs --enable-lora (the data planes' adapter slots)")
    return modules


def check_structured_outputs_backend(args) -> None:
    """An explicitly chosen grammar engine that is not installed stops the command with one
    line saying what to install (``auto`` without any only refuses constrained requests)."""
    from headrace.controlplane.structured import backends

    name = getattr(args, "structured_outputs_backend", "auto")
    if name != "auto" and not backends.installed(name):
        raise SystemExit(f"headrace: {backends.missing_message(name)}")


def check_speculative_config(args) -> None:
    """A bad ``--speculative-config`` stops the command with its message (not a child's
    traceback)."""
    from headrace.common import speculative

    try:
        speculative.parse(args.speculative_config)
    except ValueError as exc:
        raise SystemExit(f"headrace: {exc}") from None
