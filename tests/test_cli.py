"""The README's first command: `headrace serve` with no arguments serves the embedded model,
and `headrace generate` streams text from it; SIGTERM stops both planes. The serving process
(the control plane) runs with torch made unimportable: only its data plane children need it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.torchless import BLOCK_TORCH


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow   # a serve process tree
@pytest.mark.timeout(180)
def test_serve_without_arguments_then_generate_streams_text(tmp_path):
    port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
    env = dict(os.environ, HEADRACE_LOG_LEVEL="WARNING")
    serve = BLOCK_TORCH + ("from headrace.cli.main import main\n"
                           f"sys.exit(main(['serve', '--port', '{port}', '--http-port', '{http_port}', '--metrics-port', "
                           f"'{metrics_port}', '--dataplane-metrics-port', '0']))")
    log = open(tmp_path / "serve.log", "w+")   # a file, not a pipe: nothing can block on it
    server = subprocess.Popen([sys.executable, "-c", serve], env=env, start_new_session=True,
                              stderr=log)
    children: list[int] = []
    try:
        out = subprocess.run(
            [sys.executable, "-P", "-m", "headrace.cli", "generate", "hello", "--address",
             f"127.0.0.1:{port}", "--max-tokens", "24", "--connect-timeout", "120"],
            capture_output=True, text=True, timeout=150, env=env)
        assert out.returncode == 0, out.stderr
        words = out.stdout.split()
        assert len(words) >= 3, out.stdout
        assert sum(w.isalpha() for w in words) >= 2, out.stdout   # word-like text
        assert "[length: 24 tokens]" in out.stderr or "[stop:" in out.stderr
        # the same server answers OpenAI-style HTTP beside gRPC
        body = json.dumps({"messages": [{"role": "user", "content": "Good morning"}],
                           "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions",
                                         data=body, headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["finish_reason"] in ("length", "stop")
        listed = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True)
        children = [int(p) for p in listed.stdout.split()]
        assert children, "serve runs the data plane as a child process"
    finally:
        server.send_signal(signal.SIGTERM)
        returncode = server.wait(timeout=30)
        log.seek(0)
        stderr = log.read()
        assert returncode == 0, stderr[-4000:]
        assert "import of torch refused" not in stderr
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children), "data plane left running"


def test_stream_interval_below_one_is_refused_at_parse_time():
    out = subprocess.run([sys.executable, "-P", "-m", "headrace.cli", "controlplane", "--workers",
                          "127.0.0.1:1", "--stream-interval", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--stream-interval: must be >= 1, got 0" in out.stderr
