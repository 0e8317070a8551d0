"""What a new user meets (issue 51): one installed package, ``headrace``; the CPU path without
triton (CPU torch wheels do not bring it); ``headrace serve`` answering from a directory that
holds folders named ``headrace/`` and ``kernels/``; and a module that cannot be imported ending
``serve`` with one line instead of a traceback or a server that answers nothing.
(``.ci/run`` also runs the README's first command in a fresh environment with no extras.)"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

import grpc
import pytest

from headrace.common.import_errors import import_failure
from headrace.v1 import inference_pb2 as pb
from headrace.v1 import inference_pb2_grpc as pb_grpc
from tests.served import Served
from tests.torchless import BLOCK_TRITON

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOSTILE = 'raise ImportError("a folder of the current directory was imported")\n'


@pytest.mark.slow
def test_a_wheel_of_the_tree_installs_the_one_package_headrace(tmp_path):
    had_build = (ROOT / "build").exists()
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                              str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    finally:   # setuptools builds in the tree's build/: leave no copy of the sources behind
        if not had_build:
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    if out.returncode != 0 and "Could not find a version that satisfies" in out.stderr:
        pytest.skip("no package index to build the wheel's build environment from")
    assert out.returncode == 0, out.stderr[-3000:]
    [wheel] = tmp_path.glob("headrace-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"headrace"}
    folders = {"cli": "cli", "client": "client", "common": "common", "controlplane": "controlplane",
               "dataplane": "dataplane", "kernels": "kernels"}
    expected = {f"headrace/{package}/{path.relative_to(ROOT / folder).as_posix()}"
                for folder, package in folders.items() for path in (ROOT / folder).rglob("*.py")
                if "__pycache__" not in path.parts}
    expected |= {"headrace/worker/v1/worker_pb2.py", "headrace/v1/inference.proto",
                 "headrace/dataplane/default_model/tiny/config.json",
                 "headrace/kernels/quant_dispatch.json"}
    assert sorted(expected - set(names)) == []   # every module of the tree, and the data


def test_the_cpu_path_never_imports_triton():
    """Both planes in one process with triton unimportable: load the embedded model, generate."""
    probe = BLOCK_TRITON + (
        "from headrace.cli.options import default_model\n"
        "from tests.harness import Planes, completion\n"
        "planes = Planes(default_model())\n"
        "ids, text, _ = completion(planes.generate(prompt='Once upon a time', max_tokens=4))\n"
        "planes.close()\n"
        "assert len(ids) == 4 and not BLOCKED, BLOCKED\n"
        "print('generated without triton')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HEADRACE_KERNELS", "HEADRACE_TEST_DEVICE")}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "generated without triton" in out.stdout


def _headrace_command() -> list[str]:
    """The console script a user runs (beside this interpreter), else its module."""
    script = pathlib.Path(sys.executable).parent / "headrace"
    return [str(script)] if script.exists() else [sys.executable, "-P", "-m", "headrace.cli"]


@pytest.mark.slow
def test_serve_answers_from_a_directory_holding_headrace_and_kernels_folders(tmp_path):
    """The clone's parent holds ``headrace/``; Hugging Face's ``kernels`` or a project's own
    ``kernels/`` may sit beside it: neither may stand in for the installed package."""
    cwd = tmp_path / "parent"
    for name in ("headrace", "kernels", "controlplane"):
        (cwd / name).mkdir(parents=True)
        (cwd / name / "__init__.py").write_text(HOSTILE)
    served = Served(tmp_path / "serve.log", api_server_count=1, cwd=str(cwd),
                    command=_headrace_command())
    try:
        served.wait_serving()
        with grpc.insecure_channel(served.address) as channel:
            out = list(pb_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(prompt="Once upon a time", max_tokens=8), timeout=60))
        assert sum(len(r.token_ids) for r in out) == 8
        size = os.path.getsize(tmp_path / "serve.log")
        time.sleep(3)   # idle: the log must not grow (it grew 0.5 MB/s with a shadowed module)
        assert os.path.getsize(tmp_path / "serve.log") - size < 4096
    finally:
        served.close()


@pytest.mark.slow
def test_a_data_plane_that_cannot_import_triton_ends_serve_with_one_line(tmp_path):
    """``HEADRACE_KERNELS=triton`` makes the data plane import triton; a ``triton`` that is not
    there (a stand-in raising what a missing module raises) must end ``serve`` at once with
    the module, the fix and no traceback, never a server saying SERVING."""
    fake = tmp_path / "site" / "triton"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    env = dict(os.environ, HEADRACE_KERNELS="triton",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    out = subprocess.run([*_headrace_command(), "serve", "--port", "0", "--http-port", "0",
                          "--metrics-port", "0", "--dataplane-metrics-port", "0"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert time.monotonic() - start < 60
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "cannot import triton" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("headrace serve: data plane: ") and "pip install triton" in lines[0]


def test_an_import_failure_names_the_module_its_origin_and_the_fix():
    missing = import_failure(ModuleNotFoundError("No module named 'llguidance'", name="llguidance"))
    assert "cannot import llguidance" in missing and "headrace[structured]" in missing
    shadowed = import_failure(ImportError("cannot import name 'x' from 'json'", name="json"))
    assert "json comes from" in shadowed and "json" in shadowed.split("comes from")[1]
    ours = import_failure(ModuleNotFoundError("No module named 'headrace.worker.v1'",
                                              name="headrace.worker.v1"))
    assert "reinstall it" in ours and "headrace" in ours


def test_a_leftover_folder_standing_in_for_a_subpackage_is_named(monkeypatch, tmp_path):
    """A folder of ignored files left by an older version (``protos/headrace/dataplane/`` with
    only ``__pycache__``) imports as a namespace package in place of the real one: the line
    names the folder to remove."""
    import types

    stray = types.ModuleType("headrace.stray")   # a namespace package: a path, no __file__
    stray.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "headrace.stray", stray)
    line = import_failure(ImportError("cannot import name 'x' from 'headrace.stray' (unknown "
                                      "location)", name="headrace.stray"))
    assert str(tmp_path) in line and "remove that folder" in line
