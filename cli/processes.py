"""The control plane as processes (issue 18): one engine core (``python -m headrace.cli core``) and
N API front ends (``python -m headrace.cli frontend --index i``), started and kept alive by
``headrace serve`` / ``headrace controlplane``.

- ``--api-server-count N``: front ends sharing the public gRPC and HTTP ports (SO_REUSEPORT);
  by default 1 below 4 CPU cores, else min(4, cores // 2) (``default_api_server_count``).
- The ports are test-bound first without SO_REUSEPORT (``headrace.common.net.check_port``, by the
  command), so a port another server holds is refused at start although the front ends share
  it among themselves.
- A child that dies is started again on its own (a front end alone; the core alone, whose
  front ends answer UNAVAILABLE meanwhile and reconnect), after a back-off that grows while
  it keeps dying young; one that exits with the command line's usage-error status (2: a bad
  option or file, already explained on stderr) ends the server instead.
- The children share a private directory: the core's unix socket and, as
  ``PROMETHEUS_MULTIPROC_DIR``, the metric files the core's one /metrics sums.
- Secrets (API, admin and worker tokens, the core secret; given by flag, file or environment,
  ``headrace.common.secret_env``) reach the children by environment, never argv, and each child gets
  only those its role uses. The core and its front ends share a fresh core secret unless one
  is given; a TCP core address beyond loopback needs TLS (``headrace.controlplane.core.security``), checked
  before any child starts.
- ``--data-parallel-size M``: M cores (``core i``), each over its own group of data planes and
  on its own address (``headrace.cli.data_parallel``); the front ends get every core's address. Core 0
  serves the control plane's /metrics (the others' state mirrored in, ``headrace.controlplane.frontend.dp_metrics``).
  Every core gets exactly a core's secrets.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import threading
import time

from headrace.cli.roles import child_command
from headrace.common import secret_env

log = logging.getLogger("headrace.supervisor")
EXIT_USAGE = 2   # headrace.cli.main: a user's mistake, said in one line
# never forwarded on a command line: the secrets (by environment) and the tokens file (read
# by the supervisor, its entries passed by environment)
NOT_FORWARDED = ("api_token", "api_tokens_file", "admin_token", "worker_secret", "core_secret")


def default_api_server_count(cpus: int | None = None) -> int:
    cpus = cpus or os.cpu_count() or 1
    return 1 if cpus < 4 else min(4, cpus // 2)


def forward_argv(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 skip: tuple[str, ...] = ()) -> list[str]:
    """The options of ``parser`` that ``args`` sets to other than their defaults, as argv."""
    argv, seen = [], set()
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in skip or dest in NOT_FORWARDED or not hasattr(args, dest) \
                or dest in seen:
            continue
        value = getattr(args, dest)
        if value is None or value == action.default or value == parser.get_default(dest):
            continue   # (two options may share a dest: an alias with a default of None)
        seen.add(dest)
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse.BooleanOptionalAction):   # --x / --no-x: the first
            flag = action.option_strings[0]
            argv.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


# what a second SIGINT runs before the supervisor exits at once: each kills a group of children
# (SIGKILL) or removes what they leave behind (``at_force_exit``)
_FORCE_EXIT: list = []


def at_force_exit(fn) -> None:
    _FORCE_EXIT.append(fn)


def stop_on_signals(done: threading.Event, drain_timeout: float | None = None) -> None:
    """SIGINT/SIGTERM set ``done`` (a graceful stop: open streams get ``drain_timeout``); a
    second SIGINT kills every child at once and exits (status 130)."""
    def handler(sig, _frame):
        if done.is_set():
            if sig == signal.SIGINT:
                log.warning("second SIGINT: stopping every process at once")
                for fn in reversed(_FORCE_EXIT):
                    try:
                        fn()
                    except Exception:  # noqa: BLE001 - exiting anyway
                        pass
                os._exit(130)
            return
        done.set()
        log.info("stopping: open streams get up to %ss to finish (Ctrl-C again to stop at once)",
                 f"{drain_timeout:g}" if drain_timeout is not None else "a few ")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def kill_group(procs) -> None:
    """SIGKILL to each process (its own session and group: ``start_new_session``) and its group."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()


class Child:
    """``role``: "core" or "frontend N"; ``env``: its own environment (None: the group's)."""

    def __init__(self, role: str, argv: list[str], env: dict | None = None):
        self.role, self.argv, self.env = role, argv, env
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.backoff = 0.0
        self.restarts = 0


class RoleProcesses:
    """Starts ``children`` and restarts each one that dies, on its own."""

    def __init__(self, children: list[Child], env: dict, poll_s: float = 0.1, on_fatal=None):
        self.children, self._env, self._poll_s = children, env, poll_s
        at_force_exit(lambda: kill_group([c.proc for c in self.children]))
        self._on_fatal = on_fatal
        self.fatal: Child | None = None
        self._stop = threading.Event()
        for child in children:
            self._start(child)
        self._thread = threading.Thread(target=self._watch, name="headrace-roles", daemon=True)
        self._thread.start()

    def _start(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, env=child.env if child.env is not None else self._env,
                                      start_new_session=True)
        child.started = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            for child in self.children:
                if child.proc.poll() is None or self._stop.is_set():
                    continue
                if child.proc.returncode == EXIT_USAGE:
                    log.error("%s exited with a usage error; stopping", child.role)
                    self.fatal = child
                    if self._on_fatal is not None:
                        self._on_fatal()
                    return
                lived = time.monotonic() - child.started
                child.backoff = 0.0 if lived > 30 else min(10.0, max(0.25, child.backoff * 2))
                log.error("%s (pid %d) exited with %s; restarting it in %.2fs", child.role,
                          child.proc.pid, child.proc.returncode, child.backoff)
                if self._stop.wait(child.backoff):
                    return
                child.restarts += 1
                self._start(child)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, front ends first (they finish their streams), then the cores."""
        self._stop.set()
        self._thread.join(timeout=5)
        cores = [c for c in self.children if c.role.startswith("core")]
        for group in ([c for c in self.children if c not in cores], cores):
            for child in group:
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()


def control_plane_children(args, parser: argparse.ArgumentParser, workers: list,
                           core_address: str | list[str], env: dict | None = None) -> list[Child]:
    """The engine cores first, then the front ends, each with its role's secrets in its
    environment (``env``, default this process's, without any other secret). ``workers``: the
    data planes of one core, or a list of groups, one per core address (data parallelism)."""
    env = os.environ if env is None else env
    common = forward_argv(parser, args, skip=("workers", "core_address", "api_server_count",
                                              "tensor_parallel_size", "dataplane_metrics_port"))
    cores = [core_address] if isinstance(core_address, str) else list(core_address)
    groups = workers if workers and isinstance(workers[0], list) else [workers]
    core_env = secret_env.role_env("core", args, env)
    children = []
    for i, (address, group) in enumerate(zip(cores, groups, strict=True)):
        argv = child_command("core") + [*common, "--workers", ",".join(group), "--core-address", address]
        if len(cores) > 1:   # core 0 serves /metrics
            argv += ["--data-parallel-rank", str(i), "--data-parallel-size", str(len(cores))]
            argv += ["--metrics-port", "0"] if i else []
        children.append(Child("core" if len(cores) == 1 else f"core {i}", argv, core_env))
    count = args.api_server_count or default_api_server_count()
    front_env = secret_env.role_env("frontend", args, env)
    return children + [Child(f"frontend {i}", child_command("frontend") + ["--index", str(i), *common,
                                                        "--core-address", ",".join(cores)], front_env)
                       for i in range(count)]


def prepare_core_link(args) -> None:
    """The core secret (given, or a fresh one) and, for a TCP core address, the check that the
    network cannot read or use the link (``headrace.controlplane.core.security``); ValueError
    otherwise."""
    from headrace.controlplane.core import security as core_link

    secret_env.resolve(args)
    args.core_secret = args.core_secret or secrets.token_hex(16)
    tls = bool(args.core_tls_cert and args.core_tls_key and args.core_ca)
    for address in (args.core_address or "").split(","):
        if address.strip():
            core_link.check(address.strip(), tls, args.core_secret)


def run_control_plane(args, parser: argparse.ArgumentParser, workers: list[str], private_dir: str,
                      env: dict, stop_hook=None) -> bool:
    """Runs the cores and the front ends until SIGINT/SIGTERM, ``stop_hook``'s function is
    called, or a child fails for good; returns whether one did. ``workers``: the data planes
    (one flat list, cut into ``--data-parallel-size`` groups, or the groups).
    ``args.host``/``args.port`` must have been checked free (``headrace.common.net.check_port``)."""
    from headrace.cli import data_parallel

    prepare_core_link(args)
    dp = getattr(args, "data_parallel_size", 1)
    cores = data_parallel.core_addresses(args.core_address, private_dir, dp)
    if workers and not isinstance(workers[0], list):
        workers = data_parallel.split_workers(workers, dp)
    # the children's one-line failures name the command the user ran (headrace.cli.roles.failure_label)
    env = dict(env, HEADRACE_SUPERVISOR=getattr(args, "command", "serve"))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):   # headrace.common.metrics.enable_multiprocess
        env["PROMETHEUS_MULTIPROC_DIR"] = os.environ["PROMETHEUS_MULTIPROC_DIR"]
    children = control_plane_children(args, parser, workers, cores, env)
    log.info("control plane: %d engine core(s) on %s, %d API front ends on port %d", dp,
             ", ".join(cores), len(children) - dp, args.port)
    done = threading.Event()
    drain = getattr(args, "drain_timeout", 10.0)
    stop_on_signals(done, drain)
    at_force_exit(lambda: __import__("shutil").rmtree(private_dir, ignore_errors=True))
    if stop_hook is not None:
        stop_hook(done.set)
    roles = RoleProcesses(children, env, on_fatal=done.set)
    try:
        done.wait()
    finally:
        roles.stop(timeout=drain + 3)
    return roles.fatal is not None
