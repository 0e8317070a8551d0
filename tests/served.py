"""Runs ``headrace serve`` (the embedded tiny model) as a real process tree for the tests of
the process layout: supervisor, engine core, N API front ends and a data plane. Finds each
role's process, opens a channel to a chosen front end (the front ends share one port: the
kernel picks one per connection, so channels are opened until one lands on it) and reads the
control plane's one /metrics (and each process's own metric file)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, log_path, api_server_count: int = 2, extra: tuple[str, ...] = (),
                 env: dict | None = None, cwd: str | None = None, command: list[str] | None = None):
        """``extra``: more options of ``serve``; ``env``: more environment variables; ``cwd``:
        where it starts; ``command``: the ``headrace`` command (default: this interpreter's
        module, as serve starts its children)."""
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(log_path, "w+")
        # serve's temporary directory (sockets, metric files) goes in one of ours, removed by
        # close(): a test that kills the server with SIGKILL leaves nothing in /tmp either
        self.tmpdir = tempfile.mkdtemp(prefix="hrs-")
        env = dict(os.environ, HEADRACE_LOG_LEVEL="INFO", HEADRACE_LOG_FORMAT="json", TMPDIR=self.tmpdir,
                   **(env or {}))
        command = command or [sys.executable, "-P", "-m", "headrace.cli"]
        self.proc = subprocess.Popen(
            [*command, "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--http-port", "0",
             "--dataplane-metrics-port", "0", "--api-server-count", str(api_server_count), *extra],
            env=env, stderr=self.log, start_new_session=True, cwd=cwd)
        self.count = api_server_count
        self._channels: list[grpc.Channel] = []

    # -- processes -------------------------------------------------------------------------
    def role_pids(self) -> dict[str, int]:
        """'core' (or 'core 0', 'core 1', ...), 'frontend 0', ..., 'dataplane' -> pid (live
        children only)."""
        roles = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if "core" in argv and "--data-parallel-rank" in argv:   # core i of --data-parallel-size
                roles[f"core {argv[argv.index('--data-parallel-rank') + 1]}"] = child.pid
            elif "core" in argv:
                roles["core"] = child.pid
            elif "frontend" in argv:
                roles[f"frontend {argv[argv.index('--index') + 1]}"] = child.pid
            elif "dataplane" in argv:
                roles["dataplane"] = child.pid
        return roles

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    # -- channels ----------------------------------------------------------------------------
    def channel_to(self, frontend: int, tries: int = 60, options: list | None = None) -> grpc.Channel:
        """A channel whose connection a given front end accepted."""
        pid = self.role_pids()[f"frontend {frontend}"]
        self.wait_for(lambda: any(c.status == psutil.CONN_LISTEN and c.laddr.port == self.port
                                  for c in psutil.Process(pid).net_connections("tcp")),
                      60, f"front end {frontend} listening")
        me = psutil.Process()
        for _ in range(tries):
            before = {c.laddr.port for c in me.net_connections("tcp") if c.raddr and c.raddr.port == self.port}
            channel = grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)] + (options or []))
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            mine = {c.laddr.port for c in me.net_connections("tcp")
                    if c.raddr and c.raddr.port == self.port} - before
            theirs = {c.raddr.port for c in psutil.Process(pid).net_connections("tcp")
                      if c.raddr and c.laddr.port == self.port}
            if mine & theirs:
                self._channels.append(channel)
                return channel
            channel.close()
        raise AssertionError(f"no connection reached front end {frontend}")

    def health(self, channel: grpc.Channel) -> int:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status

    def wait_serving(self, timeout: float = 120.0) -> None:
        def serving():
            with grpc.insecure_channel(self.address) as channel:
                try:
                    return self.health(channel) == health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    return False
        self.wait_for(serving, timeout, "SERVING")
        self.wait_for(lambda: sum(r.startswith("frontend") for r in self.role_pids()) == self.count,
                      30, "the front ends")

    # -- metrics -----------------------------------------------------------------------------
    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def histogram_counts(self, names) -> dict[str, dict[str, float]]:
        """Role -> histogram -> its count in that process's own multiprocess metric file."""
        from prometheus_client.multiprocess import MultiProcessCollector

        roles = self.role_pids()
        directory = psutil.Process(roles["core"]).environ()["PROMETHEUS_MULTIPROC_DIR"]
        counts = {}
        for role, pid in roles.items():
            files = glob.glob(os.path.join(directory, f"histogram_{pid}.db"))
            samples = {s.name: s.value for metric in MultiProcessCollector.merge(files)
                       for s in metric.samples if s.name.endswith("_count")}
            counts[role] = {name: samples.get(f"headrace:{name}_count", 0.0) for name in names}
        return counts

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
