"""The first hour of a new user, as issue 17 tried it: every mistake at the command line is one
line on stderr and a non-zero status within seconds (no traceback, no restart loop); a port in
use is refused; serve listens on loopback by default and leaves no temporary directory;
``headrace generate`` talks to servers with a token and over TLS, names a server that is down
or loading, and leaves quietly on Ctrl-C; every option's help shows its default."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from headrace.cli.main import build_parser
from headrace.common import security
from headrace.controlplane.server import ControlPlane
from tests.checkpoints import make_checkpoint
from tests.harness import Planes

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(**extra) -> dict:
    env = dict(os.environ, HEADRACE_LOG_LEVEL="WARNING", **extra)
    for name in ("HEADRACE_API_TOKEN", "HEADRACE_ADDRESS", "HEADRACE_TLS_CA", "HEADRACE_TLS_CERT",
                 "HEADRACE_TLS_KEY", "HEADRACE_MODEL"):
        if name not in extra:
            env.pop(name, None)
    return env


def _headrace(*args, timeout=90, **env) -> subprocess.CompletedProcess:
    # Not the default HTTP and metrics ports (8000, 9400, 9401), which another test running
    # beside this one (pytest -n 2) or a server of the user's may hold.
    if args[0] in ("serve", "controlplane"):
        for flag in ("--http-port", "--metrics-port") + (("--dataplane-metrics-port",) if args[0] == "serve" else ()):
            if flag not in args:
                args += (flag, "0")
    return subprocess.run([sys.executable, "-P", "-m", "headrace.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(**env), cwd=ROOT)


# Runs argv with SIGINT's default disposition: a pytest started in the background (``&``,
# nohup, CI) passes SIGINT on ignored, and Python keeps an ignored SIGINT ignored, while a
# terminal's foreground job gets Ctrl-C. (A ``preexec_fn`` would do it in the forked child,
# which is unsafe beside this process's gRPC threads: it crashed there.)
_WITH_CTRL_C = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                "os.execv(sys.argv[1], sys.argv[1:])")


def _ctrl_c_reaches(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", _WITH_CTRL_C, *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(out: subprocess.CompletedProcess, *fragments: str) -> str:
    """stderr is one line (besides log records, which are JSON) holding every fragment."""
    lines = [line for line in out.stderr.splitlines() if line and not line.startswith("{")]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for fragment in fragments:
        assert fragment in lines[0], out.stderr
    return lines[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def broken(tmp_path_factory, model_dir):
    """Checkpoints missing one file each, and one whose weights are garbage."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name, drop in (("no-tokenizer", "tokenizer.json"), ("no-weights", "*.safetensors"),
                       ("garbage", None)):
        d = root / name
        shutil.copytree(model_dir, d)
        for f in d.glob(drop or "-"):
            f.unlink()
        out[name] = d
    for f in out["garbage"].glob("*.safetensors"):
        f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    return out


@pytest.mark.parametrize("args, fragments", [
    (["--model", "/nonexistent/model"], ["--model /nonexistent/model", "no such directory"]),
    (["--device", "tpu"], ["--device tpu", "cpu, cuda or cuda:N"]),
    (["--max-long-partial-prefills", "5"], ["--max-long-partial-prefills must be <= --max-num-partial-prefills"]),
])
def test_serve_refuses_a_mistake_in_one_line(args, fragments):
    start = time.monotonic()
    out = _headrace("serve", "--port", str(_free_port()), *args)
    assert out.returncode == 2
    _one_line(out, *fragments)
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("name, fragment", [("no-tokenizer", "no tokenizer.json"),
                                            ("no-weights", "no *.safetensors")])
def test_serve_names_the_missing_file(broken, name, fragment):
    out = _headrace("serve", "--port", str(_free_port()), "--model", str(broken[name]))
    assert out.returncode == 2
    _one_line(out, str(broken[name]), fragment)


def test_weights_that_cannot_load_end_serve_without_a_restart_loop(broken):
    start = time.monotonic()
    out = _headrace("serve", "--port", str(_free_port()), "--metrics-port", "0",
                    "--model", str(broken["garbage"]), timeout=120)
    assert out.returncode == 1
    line = _one_line(out, "cannot load the model in", str(broken["garbage"]))
    assert line.startswith("headrace serve: data plane: ")   # the command the user ran
    assert "restarting" not in out.stderr and time.monotonic() - start < 90


def test_a_childs_failure_names_the_command_the_user_ran(monkeypatch):
    from headrace.cli.roles import SUPERVISOR_ENV, failure_label

    parse = build_parser().parse_args
    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    assert failure_label(parse(["dataplane"])) == "headrace dataplane"   # run by hand
    monkeypatch.setenv(SUPERVISOR_ENV, "serve")
    assert failure_label(parse(["dataplane"])) == "headrace serve: data plane"
    assert failure_label(parse(["dataplane", "--rank", "1", "--world-size", "2"])) == \
        "headrace serve: data plane rank 1"
    assert failure_label(parse(["core", "--workers", "x:1", "--core-address", "unix:/c"])) == \
        "headrace serve: engine core"
    assert failure_label(parse(["core", "--workers", "x:1", "--core-address", "unix:/c", "--data-parallel-rank",
                                "1", "--data-parallel-size", "2"])) == "headrace serve: engine core 1"
    assert failure_label(parse(["frontend", "--index", "2", "--core-address", "unix:/c"])) == \
        "headrace serve: API front end 2"
    assert failure_label(parse(["generate", "hi"])) == "headrace generate"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be present")
def test_cuda_without_a_gpu_ends_serve_in_one_line():
    out = _headrace("serve", "--port", str(_free_port()), "--metrics-port", "0", "--device", "cuda",
                    timeout=120)
    assert out.returncode == 1
    _one_line(out, "--device cuda", "use --device cpu")


def test_a_port_in_use_is_refused_before_anything_starts(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in (["serve", "--model", str(model_dir)],
                        ["controlplane", "--model", str(model_dir), "--workers", "127.0.0.1:1"],
                        ["dataplane", "--model", str(model_dir), "--listen", f"127.0.0.1:{port}"]):
            if command[0] != "dataplane":
                command += ["--port", str(port)]
            out = _headrace(*command, "--metrics-port", "0")
            assert out.returncode == 2, (command, out.stderr)
            _one_line(out, f"127.0.0.1:{port}", "in use")


def test_a_metrics_port_in_use_is_refused_like_the_api_ports(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        free = str(_free_port())
        for command, flag in (
                (["serve", "--port", free, "--metrics-port", port], "--metrics-port"),
                (["serve", "--port", free, "--metrics-port", "0", "--dataplane-metrics-port", port],
                 "--dataplane-metrics-port"),
                (["controlplane", "--workers", "127.0.0.1:1", "--port", free, "--metrics-port", port],
                 "--metrics-port"),
                (["dataplane", "--listen", f"127.0.0.1:{free}", "--metrics-port", port], "--metrics-port"),
                # data parallelism: replica 1's data plane on --dataplane-metrics-port + 1
                *([(["serve", "-dp", "2", "--port", free, "--metrics-port", "0", "--dataplane-metrics-port",
                     str(int(port) - 1)], "--dataplane-metrics-port")] if _is_free(int(port) - 1) else [])):
            out = _headrace(*command, "--model", str(model_dir))
            assert out.returncode == 2, (command, out.stderr)
            _one_line(out, f"127.0.0.1:{port}", "in use", flag)


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _listening(port: int) -> set[str]:
    """Local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                found.add(address)
    return found


@pytest.mark.slow   # a serve process tree
@pytest.mark.timeout(180)
def test_serve_listens_on_loopback_by_default_and_leaves_no_temporary_directory(model_dir, tmp_path):
    """Also: ``--model org/name`` is served from a Hugging Face cache (offline)."""
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / ("c" * 40)
    shutil.copytree(model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("c" * 40)
    port, metrics, http = _free_port(), _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-P", "-m", "headrace.cli", "serve", "--model", "org/tiny",
                               "--port", str(port), "--metrics-port", str(metrics),
                               "--dataplane-metrics-port", "0", "--http-port", str(http)],
                              env=_env(TMPDIR=str(tmp_path), HF_HOME=str(tmp_path / "hf"),
                                       HF_HUB_OFFLINE="1"),
                              cwd=tmp_path, start_new_session=True)
    try:
        out = _headrace("generate", "hello", "--address", f"127.0.0.1:{port}", "--max-tokens", "4",
                        "--connect-timeout", "120", timeout=150)
        assert out.returncode == 0, out.stderr
        assert out.stdout.endswith("\n") and "[length: 4 tokens]" in out.stderr
        from headrace.client import Client

        with Client(f"127.0.0.1:{port}") as client:
            assert client.model_info().model_name == "org/tiny"
        for bound in (port, metrics, http):   # 127.0.0.1 (maybe v4-mapped), never 0.0.0.0 or ::
            assert _listening(bound) and _listening(bound) <= LOOPBACK, _listening(bound)
        assert list(tmp_path.glob("headrace-*")), "serve's socket directory exists while it runs"
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    assert not list(tmp_path.glob("headrace-*"))
    out = _headrace("serve", "--model", "org/absent", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    assert out.returncode == 2
    _one_line(out, "org/absent", "not in the Hugging Face cache")


def test_generate_with_an_api_token(model_dir):
    planes = Planes(model_dir, num_kv_blocks=32, plane_options={"api_token": "s3cret"})
    try:
        base = ("generate", "hi", "--address", planes.address, "--max-tokens", "3", "--ignore-eos")
        out = _headrace(*base)
        assert out.returncode == 1
        _one_line(out, "UNAUTHENTICATED")
        for out in (_headrace(*base, "--api-token", "s3cret"), _headrace(*base, HEADRACE_API_TOKEN="s3cret")):
            assert out.returncode == 0, out.stderr
            assert out.stdout.endswith("\n") and "[length: 3 tokens]" in out.stderr
    finally:
        planes.close()


def test_generate_over_mutual_tls(model_dir, certs):
    c = lambda n: str(certs / n)  # noqa: E731
    tls = security.server_credentials(c("server.pem"), c("server.key"), c("ca.pem"))
    planes = Planes(model_dir, num_kv_blocks=32, plane_options={"tls": tls},
                    secure_channel=security.channel_credentials(c("ca.pem"), c("client.pem"), c("client.key")))
    try:
        base = ("generate", "hi", "--address", planes.address, "--max-tokens", "3", "--ignore-eos")
        out = _headrace(*base, "--tls-ca", c("ca.pem"), "--tls-cert", c("client.pem"), "--tls-key", c("client.key"))
        assert out.returncode == 0, out.stderr
        out = _headrace(*base, HEADRACE_TLS_CA=c("ca.pem"), HEADRACE_TLS_CERT=c("client.pem"),
                        HEADRACE_TLS_KEY=c("client.key"))
        assert out.returncode == 0, out.stderr
        out = _headrace(*base, "--connect-timeout", "1")   # plaintext against TLS
        assert out.returncode == 1
        _one_line(out, "is down")
    finally:
        planes.close()


def test_generate_names_a_server_that_is_down_within_seconds():
    start = time.monotonic()
    out = _headrace("generate", "hi", "--address", f"127.0.0.1:{_free_port()}", "--connect-timeout", "1")
    assert out.returncode == 1 and time.monotonic() - start < 30
    _one_line(out, "is down")


def test_generate_waits_for_a_loading_server_and_leaves_quietly_on_ctrl_c(model_dir, tmp_path):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def build():
        plane = ControlPlane(str(model_dir), [f"unix:{tmp_path}/nobody.sock"], "127.0.0.1:0")
        task = asyncio.get_running_loop().create_task(plane.start(ready_timeout=60))
        while not plane.port:
            await asyncio.sleep(0.01)
        return plane, task

    plane, task = asyncio.run_coroutine_threadsafe(build(), loop).result(30)
    try:
        address = f"127.0.0.1:{plane.port}"
        out = _headrace("generate", "hi", "--address", address, "--connect-timeout", "1")
        assert out.returncode == 1
        _one_line(out, "loading")
        proc = subprocess.Popen(_ctrl_c_reaches([sys.executable, "-P", "-m", "headrace.cli", "generate", "hi", "--address",
                                                 address, "--connect-timeout", "60"]), env=_env(), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(4)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "Traceback" not in stderr and stderr == "", stderr
    finally:
        async def stop():
            task.cancel()
            await plane.stop(0)
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_admin_takes_its_options_before_or_after_the_subcommand(model_dir):
    planes = Planes(model_dir, num_kv_blocks=32, plane_options={"admin_insecure_loopback": True})
    try:
        for args in (("admin", "--address", planes.address, "config"),
                     ("admin", "config", "--address", planes.address)):
            out = _headrace(*args)
            assert out.returncode == 0, out.stderr
            assert '"numKvBlocks": 32' in out.stdout
    finally:
        planes.close()


def test_every_option_has_help_with_its_default():
    parser = build_parser()
    top = parser.format_help()
    assert "``" not in top and "`" not in top
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    parsers = dict(subs.choices)
    admin = parsers["admin"]
    admin_subs = next(a for a in admin._actions if a.__class__.__name__ == "_SubParsersAction")
    parsers.update({f"admin {k}": v for k, v in admin_subs.choices.items()})
    for name, p in parsers.items():
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.dest == "help" or action.help == "==SUPPRESS==":
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            shown = action.default not in (None, False, "", "==SUPPRESS==")
            if shown:
                assert "default" in (action.help % {"default": action.default} if "%(" in action.help
                                     else p._get_formatter()._get_help_string(action)), \
                    f"{name} {action.option_strings[0]} does not show its default"
        assert "`" not in text, name


def test_ctrl_c_in_the_middle_of_a_stream_ends_the_line_quietly(model_dir):
    planes = Planes(model_dir, num_kv_blocks=32)
    try:
        proc = subprocess.Popen(_ctrl_c_reaches([sys.executable, "-P", "-m", "headrace.cli", "generate", "hi", "--address",
                                                 planes.address, "--ignore-eos", "--max-tokens", "250"]),
                                env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = proc.stdout.read(1)
        proc.send_signal(signal.SIGINT)
        rest, stderr = proc.communicate(timeout=30)
        assert first and proc.returncode == 130, stderr
        assert (first + rest).endswith(b"\n") and stderr == b""
        assert planes.wait_for_free_blocks(32) == 32   # the request was cancelled, its blocks freed
    finally:
        planes.close()


def test_compose_and_the_image_open_the_api_and_the_checkout_has_models():
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    command = compose["controlplane"]["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert '"--host", "0.0.0.0"' in (ROOT / "Dockerfile").read_text()
    assert (ROOT / "models").is_dir()   # so Docker does not create a root-owned ./models


def test_health_and_admin_over_mutual_tls(model_dir, certs):
    """Every command that talks to a server speaks TLS/mTLS with the same flags and variables
    (a TLS deployment's compose health checks and admin calls keep working)."""
    c = lambda n: str(certs / n)  # noqa: E731
    tls = security.server_credentials(c("server.pem"), c("server.key"), c("ca.pem"))
    planes = Planes(model_dir, num_kv_blocks=32, plane_options={"tls": tls, "admin_insecure_loopback": True},
                    secure_channel=security.channel_credentials(c("ca.pem"), c("client.pem"), c("client.key")))
    flags = ("--tls-ca", c("ca.pem"), "--tls-cert", c("client.pem"), "--tls-key", c("client.key"))
    env = dict(HEADRACE_TLS_CA=c("ca.pem"), HEADRACE_TLS_CERT=c("client.pem"), HEADRACE_TLS_KEY=c("client.key"))
    try:
        out = _headrace("health", "--address", planes.address, *flags)
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
        out = _headrace("health", "--address", planes.address, **env)
        assert out.returncode == 0 and "SERVING" in out.stdout, out.stderr
        out = _headrace("health", "--address", planes.address, "--timeout", "2")   # plaintext: refused
        assert out.returncode == 1
        for args in (("admin", "--address", planes.address, *flags, "config"),
                     ("admin", "config", "--address", planes.address, *flags)):
            out = _headrace(*args)
            assert out.returncode == 0, out.stderr
            assert '"policy"' in out.stdout
        out = _headrace("health", "--address", planes.address, "--tls-cert", c("client.pem"))
        assert out.returncode != 0
        _one_line(out, "needs its key")
    finally:
        planes.close()
