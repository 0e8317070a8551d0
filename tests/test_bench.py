"""bench/: every benchmark a user runs parses ``--help`` as ``python -m bench.NAME`` (so its
imports resolve without path hacks), and bench/gpu_run.sh runs only modules that exist, by
``-m``, and stops processes by their PID or process group, never by name."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHES = ["serving_bench", "inprocess_bench", "kernels", "scheduling_sim", "hf_reference",
           "random_checkpoint", "w4_bench", "quant_kernels", "quantize_checkpoint",
           "attention_backends", "w5_bench", "core_overhead", "null_worker", "core_stream",
           "draft_acceptance", "profile_summary", "chunking_sim", "gpu_table", "tier_bench", "tier_targets",
           "step_host", "structured_bench", "fp8_kv_attention", "unified_attention", "placement_sim",
           "dp_bench", "mask_wire_bench", "mask_fill_bench", "emulated_worker", "late_mask_hops",
           "late_sample_host", "decode_ptx", "worker_start", "gemm_sass", "skinny_ncu", "read_floor",
           "quant_accuracy_gpu", "lora_adapters", "lora_bench", "lora_kernels", "det_kernels",
           "det_targets", "chaos", "lora_sim"]
SUPPORT = ["serving_http", "client_pool", "dataplane_metrics", "first_token", "w5_report", "ready"]   # imported, not run


@pytest.mark.parametrize("name", BENCHES)
def test_bench_parses_help(name, monkeypatch, capsys):
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_bench_holds_only_the_benchmarks_and_their_readme():
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"__init__"}
    assert scripts == set(BENCHES) | set(SUPPORT)
    readme = (ROOT / "bench" / "README.md").read_text()
    for name in BENCHES:
        assert f"python -m bench.{name}" in readme, name
    for name in SUPPORT:
        assert f"bench/{name}.py" in readme, name


def test_gpu_run_script_is_valid_and_runs_benches_as_modules():
    script = (ROOT / "bench" / "gpu_run.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_run.sh")], check=True)
    modules = set(re.findall(r"python3 -m bench\.(\w+)", script))
    assert {"serving_bench", "inprocess_bench", "random_checkpoint", "kernels"} <= modules <= set(BENCHES)
    assert not re.search(r"python3? (-P )?bench/", script)      # no script paths: no sys.path games
    assert "pkill" not in script and "killall" not in script and "pgrep -f" not in script
    for section in ("tests", "w1", "w1o", "w1s", "ttft", "w2", "w3", "w4", "tp"):
        assert f"has {section}" in script, section


def test_fa4_gpu_check_installs_offline_and_runs_benches_as_modules():
    script = (ROOT / "bench" / "fa4_gpu_check.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "fa4_gpu_check.sh")], check=True)
    modules = set(re.findall(r"python3 -m bench\.(\w+)", script))
    assert {"attention_backends", "inprocess_bench"} <= modules <= set(BENCHES)
    assert "--no-index --no-deps --target" in script and "dsl_packages" in script
    assert not re.search(r"python3? (-P )?bench/", script)
    assert "pkill" not in script and "killall" not in script
    for section in ("install", "tests", "bench", "w1", "long", "w3"):
        assert f"has {section}" in script, section


def test_profile_gpu_check_serves_w2_and_checks_the_trace_names_kernels():
    script = (ROOT / "bench" / "profile_gpu_check.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "profile_gpu_check.sh")], check=True)
    modules = set(re.findall(r"python3 -m bench\.(\w+)", script))
    assert {"random_checkpoint", "serving_bench", "profile_summary"} <= modules <= set(BENCHES)
    assert "--workload w2" in script and "admin profile" in script and "--steps 20" in script
    assert "--require-kernels" in script
    assert "pkill" not in script and "killall" not in script and "pgrep -f" not in script


def test_mixed_gpu_check_is_valid_and_runs_benches_as_modules():
    script = (ROOT / "bench" / "mixed_gpu_check.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "mixed_gpu_check.sh")], check=True)
    modules = set(re.findall(r"python3 -m bench\.(\w+)", script))
    assert {"step_host", "inprocess_bench", "random_checkpoint"} <= modules <= set(BENCHES)
    assert not re.search(r"python3? (-P )?bench/", script)
    assert "pkill" not in script and "killall" not in script
    for section in ("tests", "steps", "w1"):
        assert f"has {section}" in script, section


def test_step_host_times_every_phase_and_kind_on_a_cpu():
    out = subprocess.run(
        [sys.executable, "-m", "bench.step_host", "--seqs", "4", "--context", "8", "--prefill", "16",
         "--prefill-only", "32", "--steps", "2", "--warmup", "1", "--modes", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"kind"')]
    assert [r["kind"] for r in rows] == ["decode", "mixed", "prefill"]
    for r in rows:
        assert r["graph"] == "eager" and r["seqs"] == 4 and r["execute_ms"] > 0
        assert set(r["host_ms"]) == {"apply", "build", "forward", "sample", "finish"}
        assert all(v > 0 for v in r["host_ms"].values()), r
    assert "mode               kind" in out   # the table


def test_worker_start_times_a_cpu_worker_that_imports_no_compiler():
    """bench.worker_start with the embedded model on a CPU: one start's phases, and the
    construction (the model built on the meta device, then loaded) imports neither
    torch._dynamo nor torch.fx's symbolic shapes (their import was ~3 s of every start)."""
    out = subprocess.run([sys.executable, "-m", "bench.worker_start", "--repeats", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=240, check=True).stdout
    row, summary = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert row["device"] == "cpu" and row["model"] == "tiny" and summary["summary"] == "median"
    assert all(row[k] > 0 for k in ("import_torch_s", "import_worker_s", "construct_s", "total_s"))
    assert row["dynamo_imported"] is False and row["fx_symbolic_shapes_imported"] is False


@pytest.mark.slow   # a serve per mode
def test_w5_runs_on_a_cpu_with_tiny_sizes_in_every_mode():
    """W5 (multi-turn chat) end to end with the embedded tiny model, one data plane (with a host
    tier) for every mode: offloading off, and on with host hits always loaded and never
    (recomputed), off again, then two conversations one turn at a time; the same tokens
    generated (float32: no rounding to flip a token), compared conversation by conversation
    with the first mode of their kind; the host tier hit only when loaded, its hits counted as
    recomputed by never."""
    cmd = [sys.executable, "-m", "bench.w5_bench", "--device", "cpu", "--conversations", "4",
           "--turns", "3", "--user-tokens", "40", "--output-tokens", "8", "--system-tokens", "32",
           "--num-kv-blocks", "24", "--offload-gib", "0.01", "--concurrency", "2",
           "--alone-conversations", "2", "--warmup-conversations", "1",
           "--port", "50271", "--metrics-port", "50273",
           "--modes", "off,always,never,off,always/alone,off/alone",
           "--serve-args", "--max-running 8 --max-batched-tokens 256", "--ready-timeout", "120"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'protos'}")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    off, on, never, again, alone_on, alone_off = rows
    assert [r["offloading"] for r in rows] == ["off", "always", "never", "off", "always/alone", "off/alone"]
    assert off["turns"] == on["turns"] == never["turns"] == 12 and alone_on["turns"] == 6
    assert off["histories_digest"] == on["histories_digest"] == never["histories_digest"] == again["histories_digest"]
    assert alone_on["histories_digest"] == alone_off["histories_digest"]
    for row, vs, n in ((on, "off", 4), (again, "off", 4), (alone_off, "always/alone", 2)):
        assert row["tokens_vs_first"] == {"vs": vs, "same_conversations": n, "conversations": n}
    assert off["hit_rate_host"] == 0 and on["hit_rate_host"] > 0 and on["blocks_in"] > 0
    assert on["cached_prompt_tokens"] > off["cached_prompt_tokens"] and on["host_hits_recomputed"] == 0
    assert never["hit_rate_host"] == 0 and never["host_hits_recomputed"] > 0 and never["blocks_in"] == 0
    assert on["load_us_per_token"] > 0 and off["load_us_per_token"] == 0
    assert "TTFT p50" in out.stdout and "same tokens in every mode: yes" in out.stdout
    assert "same tokens in every alone mode: yes" in out.stdout


def test_client_pool_streams_from_processes_and_reports_their_cpu():
    """bench.client_pool: requests split over client processes, every token counted, each
    process's CPU use reported."""
    from bench import client_pool
    from headrace.dataplane.default_model import default_model_dir
    from tests.harness import Planes

    planes = Planes(default_model_dir())
    try:
        items = [(0.05 * i, [5, 9, 13 + i], 6, 0.0, 0) for i in range(5)] + [(0.0, [7, 8], 4, 0.0, 100000)]
        results, usage, t0 = client_pool.run(planes.address, items, processes=2, channels=2, lead_s=2.0)
    finally:
        planes.close()
    assert sorted(r["tokens"] for r in results) == [4] + [6] * 5 and all(r["ok"] for r in results)
    assert all(r["end"] > t0 and r["ttft"] <= r["e2e"] for r in results)
    assert sorted(len(r["itls"]) for r in results) == [0] + [5] * 5   # one message: no gaps
    assert usage["client_processes"] == 2 and 0 < usage["client_cpu_mean"] <= usage["client_cpu_max"]
    assert usage["client_limited"] == (usage["client_cpu_max"] >= client_pool.BUSY)


def test_dataplane_metrics_by_step_kind_and_the_idle_share():
    from bench.dataplane_metrics import delta, parse

    def page(scale):
        return "\n".join([
            "# TYPE headrace:dataplane_step_execute_seconds histogram",
            f'headrace:dataplane_step_execute_seconds_sum{{kind="decode"}} {0.5 * scale}',
            f'headrace:dataplane_step_execute_seconds_count{{kind="decode"}} {100 * scale}',
            f'headrace:dataplane_step_execute_seconds_sum{{kind="mixed"}} {0.2 * scale}',
            f'headrace:dataplane_step_execute_seconds_count{{kind="mixed"}} {10 * scale}',
            "# TYPE headrace:dataplane_step_device_seconds histogram",
            f'headrace:dataplane_step_device_seconds_sum{{kind="decode"}} {0.3 * scale}',
            f'headrace:dataplane_step_device_seconds_count{{kind="decode"}} {100 * scale}',
            f'headrace:dataplane_step_device_seconds_sum{{kind="mixed"}} {0.1 * scale}',
            f'headrace:dataplane_step_device_seconds_count{{kind="mixed"}} {10 * scale}',
            "# TYPE headrace:dataplane_device_idle_seconds counter",
            f'headrace:dataplane_device_idle_seconds_total{{kind="decode"}} {0.05 * scale}',
            f'headrace:dataplane_device_idle_seconds_total{{kind="mixed"}} {0.05 * scale}', ""])

    d = delta(parse(page(1)), parse(page(3)))
    assert d["steps_by_kind"] == {"decode": {"steps": 200, "execute_ms": 5.0, "device_ms": 3.0},
                                  "mixed": {"steps": 20, "execute_ms": 20.0, "device_ms": 10.0}}
    assert d["device_busy_s"] == 0.8 and d["device_idle_s"] == 0.2 and d["device_idle_share"] == 0.2


def test_w4_closes_in_on_the_highest_rate_that_meets_the_slo():
    from bench.w4_bench import next_rate

    rows = lambda *pairs: [{"rate": r, "meets_slo": ok} for r, ok in pairs]  # noqa: E731
    assert next_rate(rows((60, True), (100, False), (140, False))) == 80.0
    assert next_rate(rows((60, True), (100, True))) == 125.0
    assert next_rate(rows((60, False), (100, False))) == 30.0
    assert next_rate(rows((60, True), (64, False))) is None


def test_gpu_table_puts_each_target_beside_its_baseline(tmp_path):
    import json

    from bench.first_token import STAGES
    from bench.gpu_table import main

    stages = {k: 1.0 for k in STAGES} | {"sum": 12.0, "ttft": 12.5, "requests": 10}
    rate = lambda r, served: {"rate": r, "request_per_s": served, "ttft_ms_p50": 40, "ttft_ms_p99": 150,  # noqa: E731
                              "itl_ms_p50": 9, "itl_ms_p99": 30, "meets_slo": True, "client_cpu_max": 0.4,
                              "device_idle_share": 0.1,
                              "steps_by_kind": {"mixed": {"steps": 9, "execute_ms": 11.0, "device_ms": 8.0}}}
    lines = [{"workload": "w2", "label": "depth3", "ttft_ms_p50": 12.5, "itl_ms_p50": 1.3, "itl_ms_p99": 2.0,
              "first_token_ms": stages},
             {"workload": "w1", "api": "grpc", "stream_interval": 100000, "output_tok_per_s": 26000},
             {"workload": "w1", "api": "grpc", "stream_interval": 0, "output_tok_per_s": 25000,
              "client_processes": 8, "client_cpu_max": 0.5, "client_limited": False},
             {"workload": "w4", "api_server_count": 4, "max_rate_at_slo": 140, "rates": [rate(140, 139.0)]},
             {"workload": "w4", "api_server_count": 1, "max_rate_at_slo": 100, "rates": [rate(140, 80.0)]}]
    path = tmp_path / "results.jsonl"
    path.write_text("== a log line\n" + "\n".join(json.dumps(x) for x in lines) + "\n")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([str(path)])
    text = out.getvalue()
    assert "TTFT p50 12.5 ms" in text and "sum 12.00 / TTFT 12.50 ms" in text
    assert "25000 / 26000 tok/s = 96.2%" in text
    assert "highest rate at the SLO: 140 req/s" in text and "1.74x" in text and "mixed:11.0/8.0" in text


def test_w5_first_divergence_names_the_turn_and_token():
    from bench.w5_bench import parse_modes
    from bench.w5_report import compare, first_divergence

    assert first_divergence([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_divergence([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == (1, 1)
    base = {"offloading": "off", "_outputs": [[[1, 2]], [[5, 6]], [[7]]]}
    row = {"offloading": "auto", "_outputs": [[[1, 2]], [[5, 0]], [[0]]]}
    assert compare(row, base) == {"vs": "off", "same_conversations": 1, "conversations": 3,
                                  "first_divergence_turn_min": 0, "first_divergence_turn_median": 0,
                                  "first_divergence_token_median": 0.5}
    assert parse_modes("off, on,always/alone") == [("off", False), ("auto", False), ("always", True)]
    with pytest.raises(SystemExit, match="modes"):
        parse_modes("off,sometimes")


@pytest.mark.slow
def test_tier_bench_runs_on_a_cpu_with_tiny_sizes():
    """The in-process tier comparisons with the embedded tiny model: an idle tier beside none
    (both run, no preemption), and swap against recompute on a cut pool (both preempt; swap
    copies to the host tier and back, recompute copies nothing)."""
    import json

    cmd = [sys.executable, "-m", "bench.tier_bench", "--model", str(ROOT / "dataplane/default_model/tiny"),
           "--device", "cpu", "--requests", "4", "--tokens-cap", "16", "--num-kv-blocks", "64",
           "--offload-gib", "0.01", "--repeats", "1", "--swap-blocks", "4", "--max-batched-tokens", "256"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    idle = [r for r in rows if r["workload"] == "w1-tier-idle"]
    assert [r["host_tier"] for r in idle] == ["none", "idle tier"]
    assert all(r["preemptions"] == 0 and r["blocks_out"] == r["blocks_in"] == 0 for r in idle)
    assert idle[0]["output_tokens"] == idle[1]["output_tokens"] == 4 * 16
    recompute, swap = [r for r in rows if r["workload"] == "w1-preemption"]
    assert (recompute["preemption_mode"], recompute["kv_offloading_policy"]) == ("recompute", "off")
    assert (swap["preemption_mode"], swap["kv_offloading_policy"]) == ("swap", "auto")
    assert recompute["preemptions"] > 0 and swap["preemptions"] > 0 and recompute["num_kv_blocks"] == 4
    assert recompute["blocks_out"] == 0 and swap["blocks_out"] > 0 and swap["blocks_in"] > 0
    summary = {r["workload"]: r for r in rows if r["workload"].endswith("summary")}
    assert summary["w1-tier-idle-summary"]["idle_over_none"] > 0
    assert summary["w1-preemption-summary"]["over_first"]["recompute/off"] == 1.0


def test_tier_targets_judge_each_target_on_its_same_call_baseline(tmp_path):
    from bench.tier_targets import targets

    def w5(model, mode, ttft, tput, **more):
        return dict(workload="w5", model=model, offloading=mode, ttft_ms_p50=ttft, output_tok_per_s=tput,
                    hit_rate_host=0.5, load_us_per_token=5.0, recompute_us_per_token=30.0, **more)

    rows = [w5("llama8b", "off", 340.0, 2200.0), w5("llama8b", "auto", 150.0, 3000.0),
            w5("qwen3", "off", 110.0, 7000.0), w5("qwen3", "auto", 120.0, 7100.0),
            w5("qwen3", "off", 100.0, 7000.0,
               tokens_vs_first={"vs": "off", "same_conversations": 90, "conversations": 96,
                                "first_divergence_turn_min": 1}),
            {"workload": "w1-tier-idle-summary", "none_tok_per_s": 26000.0, "idle_tier_tok_per_s": 25800.0,
             "idle_over_none": 0.9923},
            {"workload": "w1-preemption-summary", "tok_per_s": {"recompute/off": 9000.0, "swap/auto": 9900.0},
             "over_first": {"recompute/off": 1.0, "swap/auto": 1.1},
             "preemptions": {"recompute/off": 500, "swap/auto": 480}}]
    tests = tmp_path / "tests.txt"
    tests.write_text("....\n12 passed in 80.00s\n")
    table = {t: (f, m) for t, f, m in targets(rows, str(tests))}
    llama = table["W5 Llama-3.1-8B: TTFT p50 >= 2x, throughput >= 1.3x"]
    assert llama[1] == "met" and "2.27x better" in llama[0] and "(1.36x)" in llama[0]
    qwen = table["W5 Qwen3-0.6B: auto within 5% of off"]   # off's median: 105 ms, 7,000 tok/s
    assert qwen[1] == "NOT met" and "off 105.0 / auto 120.0 ms" in qwen[0]
    assert "90/96 conversations equal to off, first difference at turn >= 1" in \
        table["W5 Qwen3-0.6B: tokens against the first mode"][0]
    assert table["W1 with an idle tier within 2%"][1] == "met"
    assert "swap/auto 9900 tok/s (1.10x, 480 preemptions)" in table["--preemption-mode swap vs recompute (reported)"][0]
    assert table["GPU exactness and copy tests pass"] == ("12 passed in 80.00s", "met")
    assert targets([], None)[0] == ("W5 Llama-3.1-8B", "not run", "-")
    tests.write_text("....\npytest exit 0\n")   # gpu_run.sh's status line; pytest's summary hidden by -q -q
    assert targets(rows, str(tests))[-1] == ("GPU exactness and copy tests pass", "pytest exit 0", "met")
    tests.write_text("..F\n1 failed, 2 passed in 9.00s\npytest exit 1\n")
    assert targets(rows, str(tests))[-1][1:] == ("1 failed, 2 passed in 9.00s; pytest exit 1", "NOT met")


def test_bytelevel_tokenizer_spells_text_for_grammars(tmp_path):
    """``random_checkpoint --tokenizer bytelevel``: every byte is a token, the EOS is special,
    and a grammar engine reads it (structured outputs need tokens that spell JSON)."""
    from tokenizers import Tokenizer

    from bench.random_checkpoint import write_bytelevel_tokenizer

    write_bytelevel_tokenizer(tmp_path, 2000, 1500)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 2000 and tok.id_to_token(1500) == "<|endoftext|>"
    assert tok.decode([ord("{"), ord("a")]) == "{a" and tok.decode([1500], skip_special_tokens=True) == ""
    from headrace.controlplane.structured import backends
    from headrace.controlplane.structured.spec import Constraint

    name = next((n for n in ("guidance", "xgrammar") if backends.installed(n)), None)
    if name is not None:
        m = backends.load(name, tmp_path, 2000, [1500]).compile(Constraint("regex", "[0-9]{2}")).matcher()
        assert m.accept(tok.token_to_id("4")) and m.accept(tok.token_to_id("2"))


@pytest.mark.slow
def test_structured_bench_runs_end_to_end_on_a_cpu_with_tiny_sizes(tmp_path):
    """structured_bench through a CPU server on a tiny byte-level checkpoint: the bounded
    schema's outputs, the ITL rows at two batch sizes (constrained tokens checked) and W1
    last (its call once lacked serving_bench.throughput's ``args``: a TypeError after the
    ITL rows, on the H200)."""
    pytest.importorskip("llguidance")
    pytest.importorskip("jsonschema")
    model = tmp_path / "qwen3-bl"
    make = subprocess.run([sys.executable, "-m", "bench.random_checkpoint", "qwen3-tiny", str(model),
                           "--tokenizer", "bytelevel"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, make.stderr[-2000:]
    cmd = [sys.executable, "-m", "bench.structured_bench", "--model", str(model), "--port", "50179",
           "--repeats", "1", "--batches", "1,2", "--new-tokens", "24", "--w1-requests", "3",
           "--w1-max-tokens", "6", "--clients", "1",
           "--serve-args", "--device cpu --max-running 8 --metrics-port 50181 --dataplane-metrics-port 50182",
           "--dataplane-metrics", "http://127.0.0.1:50182/metrics"]   # not 9400/9401: pytest -n 2
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [(x["batch"], x["mode"]) for x in lines if "batch" in x] == [(1, "off"), (1, "on"), (2, "off"), (2, "on")]
    w1 = [x for x in lines if x.get("workload") == "w1"]
    assert len(w1) == 1 and w1[0]["failed"] == 0 and w1[0]["output_tokens"] == sum(
        min(m, 6) for _, m, _ in __import__("bench.serving_bench").serving_bench.w1_requests()[:3])
    table = out.stdout[out.stdout.index("| measurement |"):]
    assert "ITL batch 1:" in table and "ITL batch 2:" in table and table.rstrip().splitlines()[-1].startswith("| W1")


def test_mask_wire_bench_runs_on_a_cpu_with_tiny_sizes(tmp_path):
    """mask_wire_bench on a tiny byte-level checkpoint: both forms of the same rows cross the
    stream (the shared form unpacks to the rows, asserted inside), and the shared one is the
    smaller."""
    pytest.importorskip("llguidance")
    model = tmp_path / "qwen3-bl"
    make = subprocess.run([sys.executable, "-m", "bench.random_checkpoint", "qwen3-micro", str(model),
                           "--tokenizer", "bytelevel", "--vocab-size", "8192"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, make.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "bench.mask_wire_bench", "--model", str(model), "--rows", "8",
                          "--walk", "6", "--repeats", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("{")))
    assert row["rows"] == 8 and row["vocab"] == 8192 and 1 <= row["distinct_masks"] <= 8
    assert row["shared_bytes"] < row["plain_bytes"] and set(row["round_trip_ms"]) == {"empty", "plain", "shared"}


def test_emulated_worker_keeps_the_step_protocol_and_the_device_timeline():
    """bench/emulated_worker.py under the worker's own StepPipeline: an inline bitmask and a
    late one each constrain the sampled token, a step waiting for its bitmasks gets no answer
    until they come, and a step's answer waits for its forward pass and sampling."""
    import time as _time

    import numpy as np

    from bench.emulated_worker import EmulatedRunner
    from headrace.dataplane.pipeline import StepPipeline
    from headrace.worker.v1 import worker_pb2 as wpb

    vocab, words = 1024, 32

    def mask(*allowed):
        flags = np.zeros(words * 32, dtype=np.uint8)
        flags[list(allowed)] = 1
        return wpb.TokenBitmask(seq_ids=[1], bits=np.packbits(flags, bitorder="little").tobytes())

    pipe = StepPipeline(EmulatedRunner(vocab, forward_ms=100, per_seq_ms=0, sample_ms=5, launch_ms=0))
    first = wpb.StepRequest(step_id=1, bitmask=mask(700))
    first.new_seqs.add(seq_id=1, prompt_token_ids=[5, 6, 7], block_ids=[0], num_scheduled_tokens=3)
    t0 = _time.monotonic()
    assert pipe.submit(first) == []                       # held back: the next step is launched first
    follows = wpb.StepRequest(step_id=2, running_seq_ids=[1], running_num_scheduled=[1], bitmask_follows=True)
    (answer,) = pipe.submit(follows)
    assert list(answer.token_ids) == [700] and _time.monotonic() - t0 >= 0.105   # forward + sampling
    # (step 2's forward pass runs until ~0.205 s: the late bitmasks come before it ends)
    assert pipe.submit(wpb.StepRequest(step_id=2, late_bitmask=True, bitmask=mask(33, 901))) == []
    (late,) = pipe.drain()
    assert late.step_id == 2 and late.token_ids[0] in (33, 901)
    assert _time.monotonic() - t0 >= 0.210                # two forward passes and two samplings, in turn



def test_decode_ptx_counts_the_decode_kernels_machine_code_loops():
    """bench.decode_ptx --sass: the FP8 decode kernel compiled for SM90 here (Triton's ptxas
    and nvdisasm, no GPU), its loops found; on one warp the softmax needs no barriers across
    warps, so a step has fewer than on two (why the engine's one-split tile is one warp). In a
    process of its own: this one may run Triton's interpreter, which compiles nothing."""
    pytest.importorskip("triton")
    from bench import decode_ptx
    if not decode_ptx.nvdisasm().exists():
        pytest.skip("this triton bundles no nvdisasm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "bench.decode_ptx", "--kv", "fp8", "--tiles",
                          "64/1/4,64/2/4", "--group", "4", "--sass"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    first = {}   # tile -> its first SASS loop's line (whole tiles: the unmasked loop)
    tile = None
    for line in out.splitlines():
        if line.startswith(" fp8"):
            tile = line.split(":")[0].split()[-1]
        elif "SASS loop" in line and tile not in first:
            first[tile] = {k: int(v) for k, v in re.findall(r"(BAR|F2FP|HMMA) (\d+)", line)}
    assert set(first) == {"64/1/4", "64/2/4"}, out
    assert first["64/1/4"]["HMMA"] > 0 and first["64/1/4"]["F2FP"] > 0
    assert first["64/1/4"]["BAR"] < first["64/2/4"]["BAR"]


def test_gemm_sass_counts_the_skinny_gemms_machine_code_per_weight_byte():
    """bench.gemm_sass: the W4A16 and FP8 tl.dot programs compiled for SM90 here (no GPU), each
    one's K loop found and its instructions a weight byte computed from the tile's bytes. The
    e4m3 values are converted by F2FP; the INT4 ones need no conversion instruction (magic
    numbers: a handful of I2F a step are the zero points', where converting each value took 67).
    The 16 x 32 tile on 2 warps runs the Ampere MMA with no shared-memory staging of the weight
    (why it is the 2-16-row default), and the PTX unpacking compiles and issues fewer
    instructions than the Triton one. In a process of its own (as the decode test: this one
    may run Triton's interpreter)."""
    pytest.importorskip("triton")
    from bench import decode_ptx
    if not decode_ptx.nvdisasm().exists():
        pytest.skip("this triton bundles no nvdisasm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def counted(*args):
        out = subprocess.run([sys.executable, "-m", "bench.gemm_sass", *args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300, check=True).stdout
        rows = {}
        for line in out.splitlines():
            found = re.match(r"\s*(w4a16|fp8)\s+(\S+) loop 0: (\d+) instructions a warp a "
                             r"step \((\d+) weight bytes: ([0-9.]+) a byte", line)
            if found:
                scheme, tile, total, step_bytes, per_byte = found.groups()
                ops = dict((k, int(v)) for k, v in re.findall(r"([A-Z][A-Z0-9]+) (\d+)", line))
                rows[scheme, tile] = (int(total), int(step_bytes), float(per_byte), ops)
        return rows, out

    rows, out = counted("--tiles", "16/64/4/3,16/32/2/3")
    assert set(rows) == {(s, t) for s in ("w4a16", "fp8") for t in ("16/64/4/3", "16/32/2/3")}, out
    assert rows["w4a16", "16/64/4/3"][1] == 64 * 128 // 2 and rows["fp8", "16/64/4/3"][1] == 64 * 256
    for (_, tile), (total, step_bytes, per_byte, _) in rows.items():
        warps = int(tile.split("/")[2])          # every warp of the program runs the step
        assert per_byte == pytest.approx(total * warps / step_bytes, abs=0.01)
    assert rows["fp8", "16/64/4/3"][3].get("F2FP", 0) > 0
    assert rows["w4a16", "16/64/4/3"][3].get("I2F", 0) <= 16
    narrow = rows["w4a16", "16/32/2/3"][3]
    assert narrow.get("HMMA", 0) > 0 and "HGMMA" not in narrow and "STS" not in narrow
    asm, out = counted("--asm", "--schemes", "w4a16", "--tiles", "16/64/4/3,16/32/2/3")
    for tile in ("16/64/4/3", "16/32/2/3"):
        assert asm["w4a16", tile][0] < rows["w4a16", tile][0], out
    # the one-row INT4 program: a value is a shift, one LOP3 (and-or fused) and an FMA; no
    # sign-extend of a masked value, no subtraction a value (the zero point folds per row)
    one, out = counted("--schemes", "w4a16", "--tiles", "1/64/4/1")
    total, step_bytes, per_byte, ops = one["w4a16", "1/64/4/1"]
    values = step_bytes * 2 // (4 * 32)                       # 4-bit values a thread a step
    assert "SGXT" not in ops and ops.get("FADD", 0) < values // 2, out
    assert ops["LOP3"] <= values + 4 and per_byte < 0.4, out


def test_read_floor_reads_every_word():
    """bench.read_floor's read kernel (interpreted here) sums every word of a ragged buffer at
    each config, so the floor it times is a whole read."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = ("import torch; from bench.read_floor import CONFIGS, read_sum\n"
            "buf = torch.randint(-1000, 1000, (10007,), dtype=torch.int32)\n"
            "expect = int(buf.to(torch.int64).sum()) % (1 << 32)\n"
            "assert all(read_sum(buf, c) == expect for c in CONFIGS[:3] + CONFIGS[4:5])\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_random_lora_adapters_are_served_adapters(tmp_path):
    """bench.lora_adapters writes PEFT adapters the data plane reads (all 7 projections, the
    rank asked for, alpha twice it), from the checkpoint's config.json alone."""
    import torch

    from bench.lora_adapters import write_adapters
    from headrace.dataplane.config import load_model_config
    from headrace.dataplane.lora import adapter
    from tests.checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path / "m", "llama", heads=4, kv_heads=2, head_dim=32)
    paths = write_adapters(model, tmp_path / "loras", 2, rank=4)
    read = [adapter.load(p, load_model_config(model), None, 8, torch.float32) for p in paths]
    assert [a.rank for a in read] == [4, 4] and read[0].fingerprint != read[1].fingerprint
    assert len(read[0].weights) == 2 * 7
    assert write_adapters(model, tmp_path / "loras", 2, rank=4) == paths   # kept, not rewritten


def test_lora_cold_reads_split_the_admission_around_the_read(tmp_path):
    """bench.lora_bench's cold decomposition: arrival -> read start, the read, read done -> the
    first step scheduled after it, from the server's stamps (a request without its read's
    stamps is left out)."""
    from bench.lora_bench import lora_reads
    from headrace.common.stage_times import StageLog

    log = StageLog(str(tmp_path))
    log.stamp("step:1", "scheduled", at=0.5)
    log.stamp("cold-a2", "core_received", at=1.000)
    log.stamp("lora:a2", "read_start", at=1.001)
    log.stamp("step:2", "scheduled", at=1.010)   # (another step, during the read)
    log.stamp("lora:a2", "read_done", at=1.041)
    log.stamp("step:3", "scheduled", at=1.0415)
    log.stamp("cold-a3", "core_received", at=2.0)
    log._file.flush()
    rows = lora_reads(str(tmp_path), ["cold-a2", "cold-a3"])
    assert rows == [{"request": "cold-a2", "to_read_ms": 1.0, "read_ms": 40.0, "read_to_step_ms": 0.5}]


def test_lora_sim_runs_the_slot_rule_beside_the_base_model():
    """bench.lora_sim on a short trace: the same requests with and without adapters; with
    fewer slots than adapters the slots are loaded again and again, and at a low rate both
    meet the SLO."""
    import argparse

    from bench import lora_sim

    args = argparse.Namespace(duration=5.0, seed=0, num_blocks=4000, adapters=20, max_loras=4,
                              zipf=1.0, lora_ms=0.3, load_ms=1.5)
    base, lora = lora_sim.simulate(4.0, args, False), lora_sim.simulate(4.0, args, True)
    assert base["requests"] == lora["requests"] > 0 and "slot_loads" not in base
    assert lora["slot_loads"] > args.max_loras and base["meets_slo"]
    assert lora_sim.highest([{"rate": 1, "meets_slo": True}, {"rate": 2, "meets_slo": False},
                             {"rate": 3, "meets_slo": True}]) == 1
    picks = lora_sim.zipf_choices(2000, 10, 1.0, 0)
    assert picks.count(0) > picks.count(9) * 5   # (weights 1 and 1/10)
