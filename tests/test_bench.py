"""bench/: every benchmark a user runs parses ``--help`` as ``python -m bench.NAME`` (so its
imports resolve without path hacks), and bench/gpu_run.sh runs only modules that exist, by
``-m``, and stops processes by their PID or process group, never by name."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHES = ["serving_bench", "inprocess_bench", "kernels", "scheduling_sim", "hf_reference",
           "random_checkpoint", "w4_bench", "quant_kernels", "quantize_checkpoint",
           "attention_backends", "w5_bench", "core_overhead", "null_worker", "core_stream",
           "draft_acceptance", "profile_summary"]
SUPPORT = ["serving_http"]   # modules the benchmarks import, not run on their own


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
    for section in ("tests", "w1", "w1o", "w2", "w3", "tp"):
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


@pytest.mark.slow   # a serve per mode
def test_w5_runs_on_a_cpu_with_tiny_sizes_in_every_mode():
    """W5 (multi-turn chat) end to end with the embedded tiny model: offloading off, and on
    with host hits always loaded and never (recomputed), in one invocation; the same tokens
    generated; the host tier hit only when loaded, its hits counted as recomputed by never."""
    import json
    import os

    cmd = [sys.executable, "-m", "bench.w5_bench", "--device", "cpu", "--conversations", "4",
           "--turns", "3", "--user-tokens", "40", "--output-tokens", "8", "--system-tokens", "32",
           "--num-kv-blocks", "24", "--offload-gib", "0.01", "--concurrency", "2",
           "--port", "50271", "--metrics-port", "50273", "--modes", "off,always,never",
           "--serve-args", "--max-running 8 --max-batched-tokens 256", "--ready-timeout", "120"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'protos'}")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    off, on, never = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["offloading"] for r in (off, on, never)] == ["off", "always", "never"]
    assert off["turns"] == on["turns"] == never["turns"] == 12
    assert off["histories_digest"] == on["histories_digest"] == never["histories_digest"]
    assert off["hit_rate_host"] == 0 and on["hit_rate_host"] > 0 and on["blocks_in"] > 0
    assert on["cached_prompt_tokens"] > off["cached_prompt_tokens"] and on["host_hits_recomputed"] == 0
    assert never["hit_rate_host"] == 0 and never["host_hits_recomputed"] > 0 and never["blocks_in"] == 0
    assert on["load_us_per_token"] > 0 and off["load_us_per_token"] == 0
    assert "TTFT p50" in out.stdout and "same tokens in every mode: yes" in out.stdout
