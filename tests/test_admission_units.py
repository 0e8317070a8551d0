"""Units of admission and secret hygiene without a server: API tokens naming tenants, the
tenant of a call (token, or a header trusted only when configured), the model-derived bounds,
a data plane child's environment, where /metrics binds, and Admin's loopback rule."""

from __future__ import annotations

import json

from headrace.cli.main import build_parser, dataplane_env
from headrace.common import secret_env
from headrace.cli.configs import plane_options
from headrace.common.security import DEFAULT_TENANT, ApiTokens
from headrace.controlplane.requests import limits
from headrace.controlplane.admin import admin_access, is_loopback_address
from headrace.controlplane.requests.path import RequestPath


def test_api_tokens_name_their_tenants():
    tokens = ApiTokens(["alpha=tok-a", "tok-plain", "beta=b==", "abc==", "# comment", ""])
    assert tokens.tenant("Bearer tok-a") == "alpha"
    assert tokens.tenant("Bearer tok-plain") == DEFAULT_TENANT
    assert tokens.tenant("Bearer b==") == "beta"
    assert tokens.tenant("Bearer abc==") == DEFAULT_TENANT   # base64 padding is not a tenant
    assert tokens.tenant("Bearer nope") is None and tokens.tenant(None) is None
    assert tokens.tenant("tok-a") is None
    assert tokens.tenants == {"alpha", "beta", DEFAULT_TENANT}


def test_api_tokens_load_from_flags_file_and_environment(tmp_path):
    file = tmp_path / "tokens"
    file.write_text("gamma=tok-g\n# a comment\n")
    assert ApiTokens.load(["alpha=tok-a"], str(file), environ={}).tenants == {"alpha", "gamma"}
    env = {"HEADRACE_API_TOKENS": "alpha=tok-a,beta=tok-b", "HEADRACE_API_TOKEN": "old"}
    loaded = ApiTokens.load(None, None, environ=env)
    assert loaded.tenant("Bearer tok-b") == "beta" and loaded.tenant("Bearer old") == DEFAULT_TENANT
    assert not ApiTokens.load(None, None, environ={})


class _Path:
    tokens = ApiTokens(["alpha=tok-a"])
    trust_tenant_header = False


def test_the_tenant_header_is_trusted_only_when_configured():
    path = _Path()
    meta = [("authorization", "Bearer tok-a"), ("x-headrace-tenant", "mallory")]
    assert RequestPath.tenant_of(path, meta) == "alpha"
    path.trust_tenant_header = True
    assert RequestPath.tenant_of(path, meta) == "mallory"
    assert RequestPath.tenant_of(path, [("authorization", "Bearer tok-a")]) == "alpha"


def test_bounds_follow_the_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert limits.context_bound(str(tmp_path), None) == 4096
    assert limits.context_bound(str(tmp_path), 512) == 512
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 77}}))
    assert limits.context_bound(str(tmp_path), None) == 77
    text = limits.max_text_bytes(4096, 16)
    assert text == 4096 * 16 * limits.TEXT_MARGIN
    assert limits.max_request_bytes(text, 4096) == text + limits.FIXED_REQUEST_BYTES
    assert limits.max_http_body_bytes(text, 4096) == 6 * text + limits.FIXED_REQUEST_BYTES
    assert limits.text_too_long("prompt", "x" * 100, 100) is None
    assert "at most 100 bytes" in limits.text_too_long("prompt", "x" * 101, 100)
    assert limits.text_too_long("prompt", "é" * 51, 100) is not None   # 102 bytes in 51 characters
    assert limits.text_too_long("prompt", "\ud800" * 10, 100) is None   # lone surrogates count too


def test_a_data_plane_child_gets_no_control_plane_secret():
    environ = {"PATH": "/bin", "HEADRACE_API_TOKEN": "a", "HEADRACE_API_TOKENS": "t=b",
               "HEADRACE_ADMIN_TOKEN": "c", "HEADRACE_CORE_SECRET": "d", "HEADRACE_MODEL": "/m"}
    args = build_parser().parse_args(["serve", "--worker-secret", "worker-secret"])
    secret_env.resolve(args, environ)
    env = dataplane_env(args, environ)
    assert set(secret_env.SECRET_VARS) & set(env) == {"HEADRACE_WORKER_SECRET"}
    assert env["HEADRACE_WORKER_SECRET"] == "worker-secret" and env["PATH"] == "/bin"
    assert env["HEADRACE_MODEL"] == "/m"


def test_metrics_bind_loopback_unless_told(monkeypatch):
    for name in ("HEADRACE_API_TOKEN", "HEADRACE_API_TOKENS", "HEADRACE_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    args = build_parser().parse_args(["controlplane", "--workers", "x:1", "--host", "10.1.2.3"])
    assert plane_options(args)["metrics_host"] == "127.0.0.1"   # not where the API binds
    args = build_parser().parse_args(["controlplane", "--workers", "x:1", "--metrics-host", "0.0.0.0",
                                      "--api-token", "alpha=a", "--api-token", "beta=b", "--max-n", "4"])
    opts = plane_options(args)
    assert opts["metrics_host"] == "0.0.0.0" and opts["api_token"].tenants == {"alpha", "beta"}
    assert opts["max_n"] == 4


def test_admin_is_disabled_without_a_token_unless_opted_in_on_loopback():
    for address in ("127.0.0.1:1", "[::1]:1", "localhost:1", "unix:/tmp/x", "127.0.0.2:1"):
        assert is_loopback_address(address) and admin_access(address, None, insecure_loopback=True)
        assert not admin_access(address, None) and admin_access(address, "tok")
    for address in ("0.0.0.0:1", "[::]:1", "10.0.0.1:1", "myhost:1"):
        assert not is_loopback_address(address)
        assert not admin_access(address, None, insecure_loopback=True) and admin_access(address, "tok")
