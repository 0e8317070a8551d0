"""Secrets read in one place (``headrace.common.secret_env``): a flag and its ``HEADRACE_*``
variable behave the same; each role's child gets only the secrets it uses, by environment; a secret
given by flag leaves the process's command line. End to end: ``headrace serve`` with its API and
admin tokens in the environment enforces them on gRPC, HTTP and Admin, and no process of the tree
shows a secret in its command line (``/proc/PID/cmdline``)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import psutil
import pytest

from headrace.cli.main import build_parser, controlplane_parser, dataplane_env
from headrace.cli.processes import control_plane_children
from headrace.common import secret_env
from headrace.common.security import ApiTokens, bearer_metadata
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.served import Served, free_port

ALL = {"HEADRACE_API_TOKENS": "alpha=tok-a,beta=tok-b", "HEADRACE_ADMIN_TOKEN": "adm",
       "HEADRACE_WORKER_SECRET": "wsec", "HEADRACE_CORE_SECRET": "csec"}


def _serve(argv, environ):
    args = build_parser().parse_args(["serve", *argv])
    secret_env.resolve(args, environ)
    return args


def test_flags_and_environment_resolve_to_the_same_secrets(tmp_path):
    by_env = _serve([], ALL)
    by_flag = _serve(["--api-token", "alpha=tok-a", "--api-token", "beta=tok-b", "--admin-token", "adm",
                      "--worker-secret", "wsec", "--core-secret", "csec"], {})
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("# tenants\nalpha=tok-a\n\nbeta=tok-b\n")
    by_file = _serve(["--api-tokens-file", str(tokens_file)], {k: v for k, v in ALL.items()
                                                               if k != "HEADRACE_API_TOKENS"})
    for args in (by_env, by_flag, by_file):
        assert (args.api_token, args.admin_token, args.worker_secret, args.core_secret) == \
            (["alpha=tok-a", "beta=tok-b"], "adm", "wsec", "csec")
        assert args.api_tokens_file is None   # read once, by the supervisor
    # a flag wins over the environment; nothing set is None
    assert _serve(["--admin-token", "flag"], ALL).admin_token == "flag"
    none = _serve([], {})
    assert (none.api_token, none.admin_token, none.worker_secret, none.core_secret) == (None,) * 4
    assert _serve([], {"HEADRACE_API_TOKEN": "one"}).api_token == ["one"]
    dataplane = build_parser().parse_args(["dataplane"])
    secret_env.resolve(dataplane, ALL)
    assert dataplane.worker_secret == "wsec"


def test_the_worker_secret_falls_back_to_the_file_compose_makes(tmp_path):
    made = tmp_path / "worker-secret"
    made.write_text("from-the-file\n")
    env = {"HEADRACE_WORKER_SECRET_FILE": str(made)}
    assert _serve([], env).worker_secret == "from-the-file"
    assert _serve([], dict(env, HEADRACE_WORKER_SECRET="var")).worker_secret == "var"
    assert _serve(["--worker-secret", "flag"], env).worker_secret == "flag"
    dataplane = build_parser().parse_args(["dataplane"])
    secret_env.resolve(dataplane, env)
    assert dataplane.worker_secret == "from-the-file"
    made.write_text("")
    with pytest.raises(ValueError, match="empty"):
        _serve([], env)


def test_each_role_gets_only_its_secrets_by_environment():
    environ = dict(ALL, PATH="/bin", HEADRACE_API_TOKEN="tok-c")
    args = _serve(["--api-token", "x,y=z"], environ)   # a token with a comma survives the trip
    assert args.api_token == ["x,y=z"]
    core, front = control_plane_children(args, controlplane_parser(), ["unix:/w"], "unix:/c", environ)[:2]
    secrets = lambda env: {k for k in env if k in secret_env.SECRET_VARS}  # noqa: E731
    assert secrets(dataplane_env(args, environ)) == {"HEADRACE_WORKER_SECRET"}
    assert secrets(core.env) == {"HEADRACE_WORKER_SECRET", "HEADRACE_CORE_SECRET"}
    assert secrets(front.env) == {"HEADRACE_API_TOKENS", "HEADRACE_ADMIN_TOKEN", "HEADRACE_CORE_SECRET"}
    assert core.env["PATH"] == front.env["PATH"] == "/bin"
    # the front end reads back exactly the supervisor's entries
    assert ApiTokens.load(environ=front.env).tenant("Bearer x,y=z") == "default"
    for child in (core, front):
        assert not {"x,y=z", "adm", "wsec", "csec"} & set(child.argv)
        assert "--api-tokens-file" not in child.argv


def test_a_secret_given_by_flag_leaves_the_command_line():
    code = ("import sys; from headrace.common.secret_env import scrub_argv; "
            "print(scrub_argv(['s3cret', 'alpha=tok']), flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, "--api-token", "s3cret", "--api-token=alpha=tok",
                             "--other", "s3cretly"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "True"
        argv = psutil.Process(proc.pid).cmdline()
        assert argv[-5:] == ["--api-token", "******", "--api-token=*********", "--other", "s3cretly"]
    finally:
        proc.communicate("")


@pytest.mark.timeout(300)
def test_serve_enforces_tokens_from_the_environment_and_no_process_shows_a_secret(tmp_path):
    http_port = free_port()
    server = Served(tmp_path / "serve.log", api_server_count=1,
                    extra=("--worker-secret", "flag-worker-secret", "--http-port", str(http_port)),
                    env={"HEADRACE_API_TOKENS": "alpha=tok-a,beta=tok-b", "HEADRACE_ADMIN_TOKEN": "adm-env",
                         "HEADRACE_API_TOKEN": ""})
    try:
        server.wait_serving()
        request = pb.GenerateRequest(prompt="It is", max_tokens=2, ignore_eos=True)
        with grpc.insecure_channel(server.address) as channel:
            stub, admin = pb_grpc.InferenceStub(channel), apb_grpc.AdminStub(channel)
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.Generate(request, timeout=30))
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert list(stub.Generate(request, metadata=bearer_metadata("tok-b"), timeout=30))[-1].finish_reason
            with pytest.raises(grpc.RpcError) as exc:
                admin.GetConfig(apb.GetConfigRequest(), timeout=30)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert admin.GetConfig(apb.GetConfigRequest(), metadata=bearer_metadata("adm-env"), timeout=30).ready
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        body = {"prompt": "It is", "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer tok-a"}, timeout=30).status_code == 200

        roles = server.role_pids()
        assert set(roles) == {"core", "frontend 0", "dataplane"}
        for pid in [server.proc.pid, *roles.values()]:
            argv = " ".join(psutil.Process(pid).cmdline())
            assert not any(s in argv for s in ("flag-worker-secret", "tok-a", "tok-b", "adm-env")), argv
        assert "--worker-secret ******************" in " ".join(psutil.Process(server.proc.pid).cmdline())
        env = {role: {k: v for k, v in psutil.Process(pid).environ().items() if k in secret_env.SECRET_VARS}
               for role, pid in roles.items()}
        core_secret = env["core"]["HEADRACE_CORE_SECRET"]
        assert env["dataplane"] == {"HEADRACE_WORKER_SECRET": "flag-worker-secret"}
        assert env["core"] == {"HEADRACE_WORKER_SECRET": "flag-worker-secret", "HEADRACE_CORE_SECRET": core_secret}
        assert env["frontend 0"] == {"HEADRACE_API_TOKENS": "alpha=tok-a\nbeta=tok-b\n",
                                     "HEADRACE_ADMIN_TOKEN": "adm-env", "HEADRACE_CORE_SECRET": core_secret}
    finally:
        server.close()
