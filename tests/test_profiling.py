"""On-demand profiling end to end on the CPU (Admin StartProfile / StopProfile and ``headrace admin
profile``): the data plane writes a Chrome trace of exactly the steps asked for (it parses and
holds the model's ops and one range per step), the engine core a cProfile of the same window
(pstats and a text summary), through a front end too; a stop ends a recording early even on
an idle server; bad requests and callers without the admin token are refused; a recording of
several ranks ends when every rank has reported."""

from __future__ import annotations

import asyncio
import json
import os
import pstats
import subprocess
import sys
import threading

import grpc
import pytest

from headrace.controlplane.engine.profiling import Profiler
from headrace.worker.v1 import worker_pb2 as wpb
from headrace.v1 import admin_pb2 as apb
from headrace.v1 import admin_pb2_grpc as apb_grpc
from tests.checkpoints import make_checkpoint
from tests.harness import Planes

TOKEN = "profile-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def split_planes(tmp_path_factory):
    """An engine core and an API front end (serve's layout), with an admin token."""
    model = make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)
    planes = Planes(model, num_kv_blocks=64, split=True, plane_options={"admin_token": TOKEN},
                    core_options={"core": {"admin_token": TOKEN}})
    planes.admin = apb_grpc.AdminStub(planes.channel)
    yield planes
    planes.close()


def _trace(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _check_files(status: apb.ProfileStatus, steps: int) -> None:
    assert not status.errors and not status.recording
    assert status.steps_recorded == steps
    (trace, stats, summary) = status.files
    assert os.path.basename(trace).startswith("dataplane-rank0.") and trace.endswith(".pt.trace.json")
    events = _trace(trace)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"aten::linear", "aten::embedding"} <= names   # the model's ops
    assert sum(n.startswith("headrace.step ") for n in names) == steps   # one range per step
    functions = {f"{os.path.basename(file)}:{name}" for file, _, name in pstats.Stats(stats).stats}
    assert "inflight.py:send" in functions and "step_codec.py:encode" in functions
    text = open(summary).read()
    assert "cumulative" in text and "engine core" in text


def test_a_profile_records_exactly_the_steps_asked_for(split_planes, tmp_path):
    status = split_planes.admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path), num_steps=3),
                                             metadata=AUTH)
    assert status.recording and status.num_steps == 3
    split_planes.generate(prompt="hello there", max_tokens=12, ignore_eos=True)   # 12 steps
    _check_files(split_planes.admin.StopProfile(apb.StopProfileRequest(wait_s=30), metadata=AUTH), 3)


def test_profile_summary_reads_what_the_profile_wrote(split_planes, tmp_path, capsys):
    from bench import profile_summary

    split_planes.admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path), num_steps=2), metadata=AUTH)
    split_planes.generate(prompt="hello", max_tokens=4, ignore_eos=True)
    split_planes.admin.StopProfile(apb.StopProfileRequest(wait_s=30), metadata=AUTH)
    assert profile_summary.main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (trace,) = out["traces"]
    assert trace["steps"] == 2 and trace["kernels"] == 0   # a CPU: host ops, no CUDA kernels
    assert trace["top"] and trace["by"].startswith("host op time") and out["core"]
    assert profile_summary.main([str(tmp_path), "--require-kernels"]) == 1
    assert profile_summary.main([str(tmp_path / "nothing")]) == 1


def test_a_control_plane_in_one_process_profiles_too(tmp_path_factory, tmp_path):
    model = make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", heads=4, kv_heads=2, head_dim=32)
    # no token: a loopback caller, which Admin serves only when the server opts in (issue 29)
    planes = Planes(model, num_kv_blocks=64, plane_options={"admin_insecure_loopback": True})
    try:
        admin = apb_grpc.AdminStub(planes.channel)
        admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path), num_steps=2))
        planes.generate(prompt="hello", max_tokens=5, ignore_eos=True)
        _check_files(admin.StopProfile(apb.StopProfileRequest(wait_s=30)), 2)
    finally:
        planes.close()


def test_a_stop_ends_a_recording_early_even_when_the_server_is_idle(split_planes, tmp_path):
    split_planes.admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path), num_steps=1000), metadata=AUTH)
    split_planes.generate(prompt="hello", max_tokens=4, ignore_eos=True)
    status = split_planes.admin.StopProfile(apb.StopProfileRequest(wait_s=0), metadata=AUTH)
    _check_files(status, 4)   # the stop reached the idle workers on an empty step


def test_nothing_is_recorded_without_steps_and_bad_requests_are_refused(split_planes, tmp_path):
    admin = split_planes.admin
    admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path / "idle"), num_steps=5), metadata=AUTH)
    status = admin.StopProfile(apb.StopProfileRequest(wait_s=0.2), metadata=AUTH)
    assert not status.files and "no engine step ran" in status.errors[0]
    for request, code in ((apb.StartProfileRequest(dir="relative/dir", num_steps=5), "INVALID_ARGUMENT"),
                          (apb.StartProfileRequest(dir=str(tmp_path), num_steps=0), "INVALID_ARGUMENT")):
        with pytest.raises(grpc.RpcError) as info:
            admin.StartProfile(request, metadata=AUTH)
        assert info.value.code().name == code, info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        admin.StopProfile(apb.StopProfileRequest(), metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as info:   # the admin token guards it
        admin.StartProfile(apb.StartProfileRequest(dir=str(tmp_path), num_steps=5))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_headrace_admin_profile_records_while_the_server_is_busy(split_planes, tmp_path):
    done = threading.Event()

    def traffic():
        while not done.is_set():
            split_planes.generate(prompt="the quick brown fox", max_tokens=8, ignore_eos=True)

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        out = subprocess.run(
            [sys.executable, "-P", "-m", "headrace.cli", "admin", "profile", "--steps", "5", "--dir", "profile-out",
             "--wait", "60", "--address", split_planes.address],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env=dict(os.environ, HEADRACE_ADMIN_TOKEN=TOKEN))
    finally:
        done.set()
        worker.join(60)
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["stepsRecorded"] == 5 and len(status["files"]) == 3
    assert all(f.startswith(str(tmp_path / "profile-out")) and os.path.exists(f) for f in status["files"])


def test_a_recording_of_several_ranks_ends_when_every_rank_reported(tmp_path):
    async def run():
        profiler = Profiler(2)
        profiler.start(str(tmp_path), 2)
        msg = wpb.StepRequest(step_id=1, running_seq_ids=[1])
        profiler.attach(msg)
        assert msg.profile.num_steps == 2 and msg.profile.dir == str(tmp_path)
        assert not wpb.StepRequest(step_id=2).HasField("profile")
        report = wpb.StepResult(profile_reports=[wpb.ProfileReport(rank=1, files=["r1.json"], steps=2)])
        profiler.received(report)
        assert not profiler.recording.done.is_set()   # rank 0 has not reported yet
        profiler.received(wpb.StepResult(profile_reports=[wpb.ProfileReport(rank=0, files=["r0.json"], steps=2)]))
        status = await profiler.stop(0)
        assert status.files[:2] == ["r0.json", "r1.json"] and status.steps_recorded == 2
        assert [os.path.splitext(f)[1] for f in status.files[2:]] == [".pstats", ".txt"]

    asyncio.run(run())
