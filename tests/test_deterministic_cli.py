"""``--deterministic`` on the command line: ``serve`` hands it to its data plane children and
its engine core, ``controlplane`` and ``core`` take it (the engine then demands it of its data
planes), ``dataplane`` takes it, and it is listed under the kernels' heading."""

from __future__ import annotations

import pytest

from headrace.cli.configs import engine_config
from headrace.cli.main import build_parser, controlplane_parser, serve_children_argvs
from headrace.cli.processes import control_plane_children
from headrace.common.options import from_args
from headrace.common.worker_options import WorkerOptions


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_serve_gives_the_mode_to_its_data_planes_and_its_engine():
    args = _parse("serve", "--deterministic")
    assert from_args(WorkerOptions, args).deterministic
    assert engine_config(args).deterministic
    (child,) = serve_children_argvs(args, ["unix:/tmp/x.sock"])
    assert "--deterministic" in child
    assert not engine_config(_parse("serve")).deterministic
    assert "--no-deterministic" in serve_children_argvs(_parse("serve"), ["unix:/tmp/x.sock"])[0]


def test_the_control_plane_alone_and_its_core_take_the_mode():
    args = _parse("controlplane", "--workers", "127.0.0.1:1", "--deterministic")
    assert engine_config(args).deterministic
    args.api_server_count = 1
    children = control_plane_children(args, controlplane_parser(), ["127.0.0.1:1"],
                                      "unix:/tmp/core.sock", {})
    core = next(c for c in children if c.role == "core")
    assert "--deterministic" in core.argv
    assert engine_config(_parse("core", "--workers", "x:1", "--core-address", "unix:/c",
                                "--deterministic")).deterministic
    assert _parse("dataplane", "--deterministic").deterministic


def test_the_flag_is_documented_under_the_kernels_heading(capsys):
    with pytest.raises(SystemExit):
        _parse("serve", "--help")
    text = capsys.readouterr().out
    heading = text.index("device, memory and kernels (the data plane):")
    section = text[heading:text.index("\n\n", heading)]
    assert "--deterministic" in section and "batch-invariant" in section
