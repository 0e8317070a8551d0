"""headrace.cli.processes without a model: the default front-end count, the options serve forwards
to its core and front ends (secrets by environment, not argv), and the role supervisor (a dead child
restarted alone, a usage error ending the server) with stand-in children, and the core link's fresh
secret (by environment) and TLS options reaching the core and the front ends."""

from __future__ import annotations

import sys
import time

from headrace.cli.main import build_parser, controlplane_parser
from headrace.cli.processes import (Child, RoleProcesses, control_plane_children,
                                    default_api_server_count, forward_argv)
from headrace.common import secret_env


def test_default_api_server_count_follows_the_cpu_count():
    assert [default_api_server_count(c) for c in (1, 2, 3, 4, 6, 8, 64)] == [1, 1, 1, 2, 3, 4, 4]


def test_serve_forwards_its_control_plane_options_and_keeps_secrets_off_argv():
    args = build_parser().parse_args(
        ["serve", "--model", "/m", "--port", "6000", "--http-port", "6001", "--policy", "sjf",
         "--max-num-seqs", "9", "--api-token", "sekrit", "--admin-token", "adm", "--no-prefix-cache",
         "--api-server-count", "3", "--device", "cpu", "--log-prompts"])
    secret_env.resolve(args, environ={})
    children = control_plane_children(args, controlplane_parser(), ["unix:/w.sock"], "unix:/c.sock",
                                      env={"PATH": "/bin"})
    assert [c.role for c in children] == ["core", "frontend 0", "frontend 1", "frontend 2"]
    assert children[0].argv[4] == "core" and children[2].argv[4:7] == ["frontend", "--index", "1"]
    for child in children:
        assert "sekrit" not in child.argv and "adm" not in child.argv
        parsed = build_parser().parse_args(child.argv[4:])
        assert (parsed.model, parsed.port, parsed.http_port, parsed.policy, parsed.max_num_seqs) == \
            ("/m", 6000, 6001, "sjf", 9)
        assert parsed.no_prefix_cache and parsed.log_prompts and parsed.core_address == "unix:/c.sock"
    assert "--device" not in " ".join(children[0].argv)   # a data plane option stays with serve
    # the front ends get the API and admin tokens by environment; the core neither
    assert children[1].env == {"PATH": "/bin", "HEADRACE_API_TOKENS": "sekrit\n", "HEADRACE_ADMIN_TOKEN": "adm"}
    assert children[0].env == {"PATH": "/bin"}
    assert forward_argv(controlplane_parser(), build_parser().parse_args(["serve"])) == []


def test_a_dead_child_is_restarted_alone_and_a_usage_error_is_fatal():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    children = [Child("core", sleeper), Child("frontend 0", sleeper)]
    roles = RoleProcesses(children, env={}, poll_s=0.02)
    try:
        core_pid, victim = children[0].proc.pid, children[1].proc
        victim.kill()
        deadline = time.monotonic() + 30
        # the restart is counted when it is scheduled, the new process starts after the backoff
        while (children[1].restarts == 0 or children[1].proc.pid == victim.pid) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children[1].restarts == 1 and children[1].proc.pid != victim.pid
        assert children[0].proc.pid == core_pid and children[0].restarts == 0
    finally:
        roles.stop(timeout=5)
    fatal = []
    roles = RoleProcesses([Child("core", [sys.executable, "-c", "raise SystemExit(2)"])], env={},
                          poll_s=0.02, on_fatal=lambda: fatal.append(1))
    try:
        deadline = time.monotonic() + 30
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fatal and roles.fatal is roles.children[0] and roles.children[0].restarts == 0
    finally:
        roles.stop(timeout=5)


def test_serve_gives_the_core_link_a_fresh_secret_by_environment_and_forwards_its_tls(monkeypatch, certs):
    from headrace.cli.configs import core_link_options
    from headrace.cli.processes import prepare_core_link

    for name in secret_env.SECRET_VARS:
        monkeypatch.delenv(name, raising=False)
    c = lambda n: str(certs / n)  # noqa: E731
    args = build_parser().parse_args(
        ["serve", "--model", "/m", "--core-address", "127.0.0.1:7000", "--core-tls-cert", c("server.pem"),
         "--core-tls-key", c("server.key"), "--core-ca", c("ca.pem")])
    prepare_core_link(args)
    secret = args.core_secret
    assert len(secret) == 32
    prepare_core_link(args)
    assert args.core_secret == secret   # once per server
    core, frontend = control_plane_children(args, controlplane_parser(), ["unix:/w.sock"], args.core_address)[:2]
    for child in (core, frontend):
        assert secret not in " ".join(child.argv) and child.env["HEADRACE_CORE_SECRET"] == secret
        parsed = build_parser().parse_args(child.argv[4:])
        assert (parsed.core_tls_cert, parsed.core_tls_key, parsed.core_ca) == \
            (c("server.pem"), c("server.key"), c("ca.pem"))
    monkeypatch.setenv("HEADRACE_CORE_SECRET", secret)   # as the children get it
    core_opts = core_link_options(build_parser().parse_args(core.argv[4:]), "core")
    front_opts = core_link_options(build_parser().parse_args(frontend.argv[4:]), "frontend")
    assert core_opts["core_secret"] == front_opts["core_secret"] == secret
    assert core_opts["core_tls"] is not None and front_opts["core_credentials"] is not None
