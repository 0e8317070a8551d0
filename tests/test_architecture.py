"""The layering of the tree: neither plane imports the other (``kernels/`` belongs to the data
plane), the shared layer (``common/``) imports neither plane nor the command line, and the
control plane (every module of ``controlplane/`` and ``common/``, and the ``headrace``
commands that run it) never imports torch, so a control-plane process or image can be slim."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from tests.torchless import BLOCK_TORCH

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package -> top-level packages its modules must never import
FORBIDDEN = {
    "controlplane": {"dataplane", "kernels", "cli", "torch", "triton"},
    "dataplane": {"controlplane", "cli"},
    "kernels": {"controlplane", "cli"},
    "common": {"controlplane", "dataplane", "kernels", "cli", "torch", "triton"},
}


def imported_modules(path: pathlib.Path) -> set[str]:
    """Every absolute module an import statement of ``path`` names, at any depth (imports
    inside functions count: they run too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if name.split(".")[0] in FORBIDDEN[package]:
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_across_the_layers(package):
    assert list((ROOT / package).rglob("*.py")), f"{package}/ has no modules"
    assert violations(package) == []


def test_the_import_check_sees_imports_anywhere_in_a_module(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from dataplane.worker import Worker\n"
                      "    import torch.cuda\n")
    assert {"dataplane.worker", "dataplane.worker.Worker", "torch.cuda"} <= imported_modules(module)


PROBE = BLOCK_TORCH + '''
import importlib
import pkgutil

import common
import controlplane

for package in (common, controlplane):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
from cli.main import build_parser, cmd_controlplane, cmd_serve, serve_children_argvs
from cli.configs import engine_config, plane_options
from cli.options import default_model
from controlplane.server import ControlPlane, serve_until_signal

# the control plane's whole set-up: options, the embedded model, its server (bound, then stopped)
args = build_parser().parse_args(["serve", "--max-num-seqs", "8", "-tp", "2"])
args.model = default_model()
assert len(serve_children_argvs(args, ["unix:/tmp/a", "unix:/tmp/b"])) == 2


async def bind_and_stop():
    import asyncio

    plane = ControlPlane(args.model, ["127.0.0.1:1"], "127.0.0.1:0", engine_config(args),
                         **dict(plane_options(args), metrics_port=None))
    task = asyncio.ensure_future(plane.start(ready_timeout=0.5))
    await asyncio.sleep(0.3)
    assert plane.port > 0
    task.cancel()
    await plane.stop(grace=0)

import asyncio
asyncio.run(bind_and_stop())
assert not BLOCKED and "torch" not in sys.modules, BLOCKED
print("control plane without torch: ok")
'''


def test_the_control_plane_runs_with_torch_unimportable():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "control plane without torch: ok" in out.stdout


def test_the_probe_would_notice_a_torch_import():
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import dataplane.worker\n"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0 and "import of torch refused" in out.stderr


def test_every_top_level_package_is_installed_and_copied_into_the_image():
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = pyproject[pyproject.index("packages = ["):pyproject.index("]", pyproject.index("packages = ["))]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("cli", "common", "controlplane", "dataplane", "kernels"):
        assert f'"{package}"' in packages and f"COPY {package} ./{package}" in dockerfile, package


def test_every_python_package_is_listed_for_installation():
    """A non-editable install (the image) ships only the packages pyproject lists: a new
    subpackage left out of it would be missing there while every test here passes."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = pyproject[pyproject.index("packages = ["):pyproject.index("]", pyproject.index("packages = ["))]
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in ("tests", "bench", "docs", "deploy") or rel.parts[0].startswith("."):
            continue
        parts = rel.parts[1:] if rel.parts[0] == "protos" else rel.parts
        assert f'"{".".join(parts)}"' in listed, ".".join(parts)


def test_the_engine_core_loads_no_api_stack():
    """The core process (``python -m cli core``) serves no HTTP API: it starts, and restarts
    while its front ends answer UNAVAILABLE, without importing FastAPI, pydantic or uvicorn."""
    probe = ("import sys\nimport cli.main, cli.roles, controlplane.core.server, controlplane.lifecycle\n"
             "print(sorted(m for m in ('fastapi', 'pydantic', 'uvicorn', 'controlplane.http.app') "
             "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "[]"


def test_no_installed_distribution_claims_the_kernels_import_name():
    """This project's top-level ``kernels/`` shares its import name with Hugging Face's
    ``kernels`` package, which transformers requires from 5.25 (pyproject caps transformers
    below it). Installed beside this one, the two would share site-packages/kernels in a
    non-editable install, and transformers would import this one in its place and fail at
    ``import transformers``."""
    import importlib.metadata

    import kernels

    assert pathlib.Path(kernels.__file__).resolve().parent == ROOT / "kernels"
    others = sorted({d.metadata["Name"] for d in importlib.metadata.distributions()
                     if d.metadata["Name"] and d.metadata["Name"].lower() == "kernels"})
    assert not others, ("Hugging Face's `kernels` is installed: it shadows (or is shadowed by) "
                        "this project's kernels/ package; uninstall it (transformers < 5.25 "
                        "does not need it)")
