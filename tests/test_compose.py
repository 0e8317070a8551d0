"""Deployment files: the compose stack's shape (always), `docker compose config` on both
variants (where a compose CLI is installed), and a smoke test that builds the image, brings
the CPU stack up and streams one generation through it (opt-in: HEADRACE_DOCKER_SMOKE=1, and
only where a Docker engine runs)."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_FILE, CPU_FILE = ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml"


def _load(path):
    return yaml.safe_load(path.read_text())


def test_compose_declares_the_operations_stack():
    gpu = _load(GPU_FILE)["services"]
    assert {"controlplane", "dataplane", "otel-collector", "jaeger", "prometheus"} <= set(gpu)
    # the data plane reserves a GPU
    (device,) = gpu["dataplane"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "cuda" in gpu["dataplane"]["command"]
    for name, port in (("controlplane", "8000/ready"), ("dataplane", "50061")):
        service = gpu[name]
        check = service["healthcheck"]
        probe = ["CMD", "python", "-c"] if name == "controlplane" else ["CMD", "headrace", "health"]
        assert check["test"][:3] == probe and port in check["test"][-1]
        assert check["start_period"].endswith("m")       # model loading takes minutes
        assert any(v.endswith(":/models:ro") for v in service["volumes"])   # model weights
        env = service["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_SERVICE_NAME"] == f"headrace-{name}"
        _reads_the_made_secret(service)
        assert "HEADRACE_API_TOKEN" not in env or name == "controlplane"
    # Prometheus scrapes both planes; the collector forwards traces to Jaeger
    prom = _load(ROOT / "deploy" / "prometheus.yml")
    targets = {t for job in prom["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"controlplane:9400", "dataplane:9401"}
    assert gpu["controlplane"]["ports"][-1].endswith("8000}:8000") and "8000" in gpu["controlplane"]["command"]
    assert "--metrics-port" in gpu["controlplane"]["command"] and "9400" in gpu["controlplane"]["command"]
    assert "9401" in gpu["dataplane"]["command"]
    otel = _load(ROOT / "deploy" / "otel-collector.yaml")
    assert otel["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert otel["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]


def test_cpu_variant_runs_without_gpus():
    cpu = _load(CPU_FILE)["services"]
    assert cpu["dataplane"]["profiles"] == ["gpu"]          # the GPU data plane stays down
    worker = cpu["dataplane-cpu"]
    assert "deploy" not in worker and "cpu" in worker["command"]
    assert worker["networks"]["default"]["aliases"] == ["dataplane"]
    assert worker["healthcheck"]["test"][:3] == ["CMD", "headrace", "health"]
    _reads_the_made_secret(worker)
    assert cpu["controlplane"]["image"] == worker["image"] == cpu["secret-init"]["image"] == "headrace:cpu"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE" in dockerfile and "ENTRYPOINT" in dockerfile


def _reads_the_made_secret(service: dict) -> None:
    """A plane takes the operator's HEADRACE_WORKER_SECRET when set (no ``:?``: compose must
    start with nothing set), else the file secret-init made, from the volume, read-only."""
    env = service["environment"]
    assert env["HEADRACE_WORKER_SECRET"] in ("${HEADRACE_WORKER_SECRET:-}", "${HEADRACE_WORKER_SECRET}")
    assert env["HEADRACE_WORKER_SECRET_FILE"] == "/run/headrace-secret/worker-secret"
    assert "headrace-secret:/run/headrace-secret:ro" in service["volumes"]
    assert service["depends_on"]["secret-init"]["condition"] == "service_completed_successfully"


def test_secret_init_makes_one_secret_and_keeps_it(tmp_path, monkeypatch):
    """The one-shot service's program, run against a directory here: a fresh 0600 secret the
    first time, the same one on every later start; the planes read it through
    ``headrace.common.security.worker_secret`` unless the operator set HEADRACE_WORKER_SECRET."""
    from headrace.common import security

    compose = _load(GPU_FILE)
    init = compose["services"]["secret-init"]
    assert init["restart"] == "no" and init["volumes"] == ["headrace-secret:/run/headrace-secret"]
    assert "headrace-secret" in compose["volumes"]
    program = init["entrypoint"][-1].replace("/run/headrace-secret", str(tmp_path))
    subprocess.run([sys.executable, "-c", program], check=True)
    secret_file = tmp_path / "worker-secret"
    made = secret_file.read_text()
    assert len(made) == 64 and int(made, 16) >= 0
    assert secret_file.stat().st_mode & 0o777 == 0o600
    subprocess.run([sys.executable, "-c", program], check=True)
    assert secret_file.read_text() == made
    env = {"HEADRACE_WORKER_SECRET": "", "HEADRACE_WORKER_SECRET_FILE": str(secret_file)}
    assert security.worker_secret(None, env) == made
    assert security.worker_secret(None, dict(env, HEADRACE_WORKER_SECRET="mine")) == "mine"
    assert security.worker_secret("flag", env) == "flag"
    assert security.worker_secret(None, {}) is None
    with pytest.raises(ValueError, match="cannot read"):
        security.worker_secret(None, {"HEADRACE_WORKER_SECRET_FILE": str(tmp_path / "missing")})


def test_the_image_command_is_exec_form_and_metrics_open_only_where_scraped():
    """CMD must be a JSON array alone on its line (anything after it turns it into a shell
    command); /metrics binds beyond loopback only where Prometheus scrapes it, by flag."""
    import json

    (cmd,) = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("CMD ")]
    assert json.loads(cmd[4:]) == ["serve", "--host", "0.0.0.0"]
    services = _load(GPU_FILE)["services"] | {"dataplane-cpu": _load(CPU_FILE)["services"]["dataplane-cpu"]}
    for name in ("controlplane", "dataplane", "dataplane-cpu"):
        command = services[name]["command"]
        assert command[command.index("--metrics-host") + 1] == "0.0.0.0", name


def _compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.parametrize("files", [[GPU_FILE], [GPU_FILE, CPU_FILE]], ids=["gpu", "cpu"])
def test_compose_config_is_valid(files):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI installed (docker compose / docker-compose); .ci/run installs one")
    args = [a for f in files for a in ("-f", str(f))]
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("HEADRACE_", "OTEL_"))}
    done = subprocess.run(cli + args + ["config", "-q"], cwd=ROOT, capture_output=True, text=True, env=bare)
    assert done.returncode == 0, done.stderr   # nothing set: a fresh clone's `docker compose up`
    assert "WARNING" not in done.stderr, done.stderr   # no variable is unset without a default
    done = subprocess.run(cli + args + ["config", "-q"], cwd=ROOT, capture_output=True, text=True,
                          env={**bare, "HEADRACE_MODEL": "/models/x", "HEADRACE_WORKER_SECRET": "s"})
    assert done.returncode == 0, done.stderr


# -- smoke test ---------------------------------------------------------------------------------
def _docker_ok() -> str | None:
    """None when a Docker engine answers, else why not."""
    if not shutil.which("docker"):
        return "no docker CLI"
    done = subprocess.run(["docker", "info"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"no Docker engine reachable ({done.stderr.strip()[:120]})"


def _image_available(image: str) -> bool:
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0:
        return True
    try:
        return subprocess.run(["docker", "pull", image], capture_output=True, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(1800)
@pytest.mark.skipif(os.environ.get("HEADRACE_DOCKER_SMOKE") != "1",
                    reason="builds the image and runs the CPU compose stack (minutes); "
                           "set HEADRACE_DOCKER_SMOKE=1 where a Docker engine runs")
def test_cpu_compose_stack_streams_a_generation(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from headrace.v1 import inference_pb2 as pb
    from headrace.v1 import inference_pb2_grpc as pb_grpc
    from tests.checkpoints import make_checkpoint

    why = _docker_ok()
    if why:
        pytest.skip(why)
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose CLI installed")
    base = os.environ.get("HEADRACE_SMOKE_BASE_IMAGE", "python:3.11-slim")
    if not _image_available(base):
        pytest.skip(f"base image {base} is neither local nor pullable (no registry?); build a "
                    "stand-in with deploy/offline-base-image.sh and set HEADRACE_SMOKE_BASE_IMAGE")
    build = subprocess.run(["docker", "build", "--network", "host", "--build-arg", f"BASE_IMAGE={base}",
                            "-t", "headrace:cpu", str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]

    models = tmp_path / "models"
    make_checkpoint(models / "tiny", "llama", heads=4, kv_heads=2, head_dim=32)
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = _free_port()
    services = ["controlplane", "dataplane-cpu"]
    extra = {"otel-collector": "otel/opentelemetry-collector:0.115.1",
             "jaeger": "jaegertracing/all-in-one:1.63.0", "prometheus": "prom/prometheus:v2.55.1"}
    observability = all(_image_available(image) for image in extra.values())
    if observability:
        services += list(extra)
    # no HEADRACE_WORKER_SECRET: secret-init makes the planes' secret
    env = {**{k: v for k, v in os.environ.items() if k != "HEADRACE_WORKER_SECRET"},
           "HEADRACE_MODELS": str(models), "HEADRACE_MODEL": "/models/tiny",
           "HEADRACE_PORT": str(port), "JAEGER_UI_PORT": str(_free_port()),
           "PROMETHEUS_PORT": str(_free_port()),
           "OTEL_TRACES_EXPORTER": "otlp" if observability else "none"}
    compose = cli + ["-p", f"headrace-smoke-{port}", "-f", str(GPU_FILE), "-f", str(CPU_FILE)]
    up = subprocess.run(compose + ["up", "-d", "--no-build", *services], cwd=ROOT, env=env,
                        capture_output=True, text=True)
    try:
        assert up.returncode == 0, up.stderr
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline, status = time.monotonic() + 300, None
            while time.monotonic() < deadline:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(1)
            logs = subprocess.run(compose + ["logs", "--tail", "30"], cwd=ROOT, env=env,
                                  capture_output=True, text=True).stdout
            assert status == health_pb2.HealthCheckResponse.SERVING, logs
            responses = list(pb_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt="the quick", max_tokens=8, ignore_eos=True), timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 8
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
        ps = subprocess.run(compose + ["ps"], cwd=ROOT, env=env, capture_output=True, text=True).stdout
        assert "dataplane-cpu" in ps and "_dataplane_1" not in ps and "-dataplane-1" not in ps
    finally:
        subprocess.run(compose + ["down", "-v"], cwd=ROOT, env=env, capture_output=True)
