"""Worker options are defined once (``headrace.common.worker_options``): the ``headrace`` flags are
generated from them, an instance serialises itself to argv and parses back equal, ``serve``
hands its children every worker option, ``--max-running`` is ``--max-num-seqs``'s synonym,
``serve --help`` lists its options under headings, renamed flags keep their old spelling
hidden, and the defaults a new user meets (``--device auto``, ``generate``'s 16 tokens). Plus
the gRPC settings both planes share agree with each other."""

from __future__ import annotations

import dataclasses
import re

import pytest

from headrace.cli.main import CONTROL_PLANE_WORKER_OPTIONS, build_parser, serve_children_argvs
from headrace.cli.configs import engine_config
from headrace.common import grpc_options
from headrace.common.options import (DEVICE, GROUPS, MODEL, OBSERVABILITY, PARALLEL, SCHEDULING,
                                     SECURITY, SERVER, from_args, to_argv)
from headrace.common.worker_options import ParallelOptions, WorkerOptions
from headrace.dataplane.worker import WorkerOptions as DataPlaneWorkerOptions

# a value unlike the default for every field (None where the default is a value, and back)
CHANGED = WorkerOptions(model="/models/x", device="cuda:1", dtype="float16", block_size=32,
                        max_model_len=4096, num_kv_blocks=123, max_num_seqs=77,
                        max_batched_tokens=999, cpu_kv_cache_gib=2.5,
                        gpu_memory_utilization=0.55, cuda_graphs=False, enforce_eager=True,
                        cudagraph_mode="piecewise", max_cudagraph_capture_size=1024, seed=7,
                        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
                        quantization="fp8", kv_cache_dtype="fp8", attention_backend="flash-attn",
                        kv_offloading_size=1.5, quant_backend="gemlite", enable_lora=True,
                        max_loras=4, max_lora_rank=32, max_cpu_loras=8, deterministic=True)


def _dataplane(argv: list[str]):
    return build_parser().parse_args(["dataplane", *argv])


def test_changed_differs_from_the_defaults_in_every_field():
    default = WorkerOptions(model="m")
    for field in dataclasses.fields(WorkerOptions):
        assert getattr(CHANGED, field.name) != getattr(default, field.name), field.name


def test_the_data_plane_builds_workers_from_the_one_definition():
    assert DataPlaneWorkerOptions is WorkerOptions


@pytest.mark.parametrize("opts", [CHANGED, WorkerOptions(model="/m"),
                                  dataclasses.replace(CHANGED, dtype=None, num_kv_blocks=None,
                                                      max_model_len=None, cuda_graphs=True)])
def test_worker_options_round_trip_through_argv(opts):
    assert from_args(WorkerOptions, _dataplane(to_argv(opts))) == opts


def test_parallel_options_round_trip_through_argv():
    par = ParallelOptions(rank=3, world_size=4, dist_init="tcp://10.0.0.1:2345", dist_timeout=12.5)
    assert from_args(ParallelOptions, _dataplane(to_argv(par))) == par


def _serve(*flags: str):
    args = build_parser().parse_args(["serve", *flags])
    args.model = args.model or "/models/x"
    return args


def test_serve_passes_every_worker_option_to_its_children():
    args = _serve(*to_argv(CHANGED), "--dataplane-metrics-port", "9500")
    (argv,) = serve_children_argvs(args, ["unix:/tmp/dp.sock"])
    assert argv[1:5] == ["-P", "-m", "headrace.cli", "dataplane"]
    child = _dataplane(argv[5:])
    assert from_args(WorkerOptions, child) == CHANGED
    assert (child.listen, child.metrics_port) == ("unix:/tmp/dp.sock", 9500)
    assert from_args(ParallelOptions, child) == ParallelOptions()


def test_serve_gives_each_tensor_parallel_rank_its_device_and_rank():
    args = _serve("--device", "cuda", "-tp", "2", "--max-num-seqs", "64")
    children = [_dataplane(argv[5:]) for argv in serve_children_argvs(args, ["unix:/a", "unix:/b"])]
    pars = [from_args(ParallelOptions, c) for c in children]
    assert [(p.rank, p.world_size) for p in pars] == [(0, 2), (1, 2)]
    assert pars[0].dist_init == pars[1].dist_init and pars[0].dist_init.startswith("tcp://127.0.0.1:")
    opts = [from_args(WorkerOptions, c) for c in children]
    assert [o.device for o in opts] == ["cuda:0", "cuda:1"] and {o.max_num_seqs for o in opts} == {64}
    assert [c.metrics_port for c in children] == [9401, 9402]


def test_max_num_seqs_limits_the_scheduler_and_the_worker_alike():
    args = _serve("--max-num-seqs", "48", "--max-batched-tokens", "512")
    assert from_args(WorkerOptions, args).max_num_seqs == 48
    assert (engine_config(args).max_running, engine_config(args).max_batched_tokens) == (48, 512)
    control = build_parser().parse_args(["controlplane", "--workers", "x:1", "--max-num-seqs", "5"])
    assert engine_config(control).max_running == 5
    not_its_own = {f.name for f in dataclasses.fields(WorkerOptions)} - set(CONTROL_PLANE_WORKER_OPTIONS)
    assert not not_its_own & set(vars(control))   # the control plane alone takes only its share


def test_the_chunking_flags_reach_the_scheduler_and_a_bad_pair_is_named():
    from headrace.controlplane.scheduling.chunking import Chunking

    assert engine_config(_serve()).chunking == Chunking()
    args = _serve("--max-prefill-tokens-with-decodes", "512", "--max-num-partial-prefills", "3",
                  "--max-long-partial-prefills", "2", "--long-prefill-token-threshold", "100")
    assert engine_config(args).chunking == Chunking(512, 3, 2, 100)
    control = build_parser().parse_args(["controlplane", "--workers", "x:1",
                                         "--max-prefill-tokens-with-decodes", "64"])
    assert engine_config(control).chunking.max_prefill_tokens_with_decodes == 64
    with pytest.raises(ValueError, match="--max-long-partial-prefills must be <= --max-num-partial-prefills"):
        engine_config(_serve("--max-long-partial-prefills", "5"))
    with pytest.raises(SystemExit):
        _serve("--max-num-partial-prefills", "0")


def test_the_offloading_policy_is_the_control_planes():
    assert engine_config(_serve()).kv_offloading_policy == "auto"
    control = build_parser().parse_args(["controlplane", "--workers", "x:1",
                                         "--kv-offloading-policy", "never"])
    assert engine_config(control).kv_offloading_policy == "never"
    assert engine_config(_serve("--kv-offloading-policy", "off")).kv_offloading_policy == "off"
    with pytest.raises(SystemExit):
        _serve("--kv-offloading-policy", "sometimes")


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return capsys.readouterr().out


def _sections(text: str) -> dict[str, str]:
    """``--help`` output by heading (``title:`` lines at the start of a line)."""
    out, title = {}, ""
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
        out[title] = out.get(title, "") + line + "\n"
    return out


@pytest.mark.parametrize("command", ["serve", "dataplane", "controlplane"])
def test_max_running_is_a_visible_synonym_of_max_num_seqs(command, capsys):
    extra = ["--workers", "x:1"] if command == "controlplane" else []
    args = build_parser().parse_args([command, *extra, "--max-running", "9"])
    assert args.max_num_seqs == 9 and not hasattr(args, "max_running")
    sections = _sections(_help(capsys, command))
    assert "--max-num-seqs MAX_NUM_SEQS, --max-running MAX_NUM_SEQS" in sections[SCHEDULING]


def test_serve_help_lists_every_option_under_a_heading(capsys):
    sections = _sections(_help(capsys, "serve"))
    assert set(GROUPS) <= set(sections)
    assert sections["options"].count("--") == 1   # --help alone stays outside the headings
    expect = {MODEL: ["--model", "--dtype", "--quantization", "--chat-template",
                      "--structured-outputs-backend"],
              DEVICE: ["--device", "--gpu-memory-utilization", "--kv-cache-dtype", "--cudagraph-mode",
                       "--enforce-eager", "--max-cudagraph-capture-size", "--quant-backend"],
              PARALLEL: ["--tensor-parallel-size", "--data-parallel-size", "--data-parallel-placement",
                         "--data-parallel-balance-threshold", "--data-parallel-balance-ratio"],
              SCHEDULING: ["--policy", "--max-batched-tokens", "--max-queued",
                           "--max-prefill-tokens-with-decodes", "--max-num-partial-prefills",
                           "--max-long-partial-prefills", "--long-prefill-token-threshold",
                           "--kv-offloading-policy", "--max-prompts-per-request"],
              SERVER: ["--host", "--port", "--http-port", "--api-server-count", "--http-header-timeout",
                       "--http-keep-alive-timeout"],
              SECURITY: ["--api-token", "--admin-token", "--worker-secret", "--tls-cert",
                         "--admin-insecure-loopback", "--model-root"],
              OBSERVABILITY: ["--metrics-port", "--log-format", "--dataplane-metrics-port", "--metrics-host"]}
    for title, flags in expect.items():
        for flag in flags:
            assert any(f"  {flag}{end}" in sections[title] for end in " ,\n"), (title, flag)
    model = " ".join(sections[MODEL].split())
    assert "Hub id" in model and "{float32,bfloat16,float16," in model
    assert _serve().device == "auto" and "auto (CUDA when a GPU is visible" in " ".join(sections[DEVICE].split())


@pytest.mark.parametrize("command", ["controlplane", "dataplane"])
def test_the_planes_list_every_option_under_a_heading(command, capsys):
    sections = _sections(_help(capsys, command))
    assert sections["options"].count("--") == 1, sections["options"]
    if command == "controlplane":   # the data-parallel cores over running data planes
        for flag in ("--data-parallel-size", "--data-parallel-placement", "--data-parallel-balance-threshold",
                     "--data-parallel-balance-ratio"):
            assert f"  {flag}" in sections[PARALLEL], flag


def test_device_auto_picks_cuda_only_when_a_gpu_is_visible(monkeypatch):
    import torch

    from headrace.dataplane.worker import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu"
    # serve passes auto on: each rank resolves it (cuda:r under tensor parallelism)
    children = serve_children_argvs(_serve("-tp", "2"), ["unix:/a", "unix:/b"])
    assert {from_args(WorkerOptions, _dataplane(argv[5:])).device for argv in children} == {"auto"}


def test_renamed_flags_keep_their_old_spelling_hidden(capsys):
    parse = build_parser().parse_args
    assert parse(["admin", "--api-token", "t", "config"]).api_token == "t"
    assert parse(["admin", "config", "--api-token", "t"]).api_token == "t"
    assert parse(["admin", "config", "--token", "old"]).api_token == "old"
    assert "--token is deprecated; use --api-token" in capsys.readouterr().err
    assert parse(["dataplane", "--secret", "s"]).worker_secret == "s"
    assert parse(["dataplane", "--worker-secret", "s"]).worker_secret == "s"
    assert parse(["generate", "hi", "--wait", "7"]).connect_timeout == 7.0
    assert parse(["admin", "set", "--max-num-seqs", "3"]).max_running == 3
    capsys.readouterr()
    for argv, old in ((("admin", "config"), "--token"), (("dataplane",), "--secret"),
                      (("generate",), "--wait")):
        assert not re.search(rf"(^|[\s,\[]){old}\b", _help(capsys, *argv)), old


def test_generate_asks_for_16_tokens_by_default_like_the_http_api():
    assert build_parser().parse_args(["generate", "hi"]).max_tokens == 16
    assert build_parser().parse_args(["generate", "hi", "--max-tokens", "99"]).max_tokens == 99


def test_cuda_graphs_flag_pair():
    assert _dataplane([]).cuda_graphs is True
    assert _dataplane(["--no-cuda-graphs"]).cuda_graphs is False


def test_grpc_keepalive_settings_agree_across_the_planes():
    server = dict(grpc_options.server_options(grpc_options.STEP_MAX_MESSAGE_BYTES))
    public = dict(grpc_options.public_server_options(1 << 20))
    channel = dict(grpc_options.channel_options())
    # a channel never pings more often than a server accepts (else: GOAWAY too_many_pings)
    assert channel["grpc.keepalive_time_ms"] >= server["grpc.http2.min_ping_interval_without_data_ms"]
    for key in ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
                "grpc.keepalive_permit_without_calls"):
        assert server[key] == public[key] == channel[key]
    # the channel takes any message a data plane server may send
    assert channel["grpc.max_receive_message_length"] >= server["grpc.max_send_message_length"]
    assert public["grpc.max_receive_message_length"] == 1 << 20
    assert public["grpc.max_send_message_length"] == grpc_options.PUBLIC_MAX_SEND_BYTES
    # the public server's receive window is fixed (an oversized call cannot fill its memory
    # before it is refused); the private links keep gRPC's growing windows
    assert public["grpc.http2.bdp_probe"] == 0
    assert public["grpc.http2.lookahead_bytes"] == grpc_options.PUBLIC_RECEIVE_WINDOW_BYTES
    assert "grpc.http2.bdp_probe" not in server
