"""The layering of the tree: neither plane imports the other (``kernels/`` belongs to the data
plane), the shared layer (``common/``) imports neither plane nor the command line, the control
plane (every module of ``controlplane/`` and ``common/``, and the ``headrace`` commands that run
it) never imports torch, so a control-plane process or image can be slim, and no two modules
import each other (an import circle makes a reader hold both files at once)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from tests.torchless import BLOCK_TORCH

ROOT = pathlib.Path(__file__).resolve().parents[1]

# folder -> the import namespace's subpackages its modules must never import (and libraries)
FORBIDDEN = {
    "controlplane": {"headrace.dataplane", "headrace.kernels", "headrace.cli", "torch", "triton"},
    "dataplane": {"headrace.controlplane", "headrace.cli"},
    "kernels": {"headrace.controlplane", "headrace.cli"},
    "common": {"headrace.controlplane", "headrace.dataplane", "headrace.kernels", "headrace.cli",
               "torch", "triton"},
    "client": {"headrace.controlplane", "headrace.dataplane", "headrace.kernels", "headrace.cli",
               "torch"},
}
# the folders of the installed packages and their import names (pyproject's package-dir)
PACKAGE_DIRS = {"cli": "headrace.cli", "client": "headrace.client", "common": "headrace.common",
                "controlplane": "headrace.controlplane", "dataplane": "headrace.dataplane",
                "kernels": "headrace.kernels", "protos/headrace": "headrace"}
# the generic names the tree's folders had as top-level packages before the one namespace
OLD_TOP_LEVEL = ("cli", "common", "controlplane", "dataplane", "kernels", "headrace_client")


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


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(package: str) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if _under(name, FORBIDDEN[package]):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT)
    for folder, package in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if rel.as_posix().startswith(folder + "/"):
            parts = list(rel.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise ValueError(path)


def installed_modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if "default_model" in path.parts and path.name == "train.py":
                continue
            out[module_name(path)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the installed modules it imports (``from p import m`` counts m when m is a
    module of p)."""
    modules = installed_modules()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imported_modules(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_across_the_layers(package):
    assert list((ROOT / package).rglob("*.py")), f"{package}/ has no modules"
    assert violations(package) == []


def test_no_two_modules_import_each_other():
    graph = import_graph()
    circles = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets
                      if a in graph.get(b, ()) and not a.startswith(b + ".")
                      and not b.startswith(a + ".")})
    assert circles == []


def test_no_module_imports_the_old_top_level_names():
    """Everything installed lives under ``headrace``: an import of a bare ``kernels`` or
    ``controlplane`` would reach another distribution's package (Hugging Face's ``kernels``) or
    a folder of the current directory."""
    old = []
    for folder in ("cli", "client", "common", "controlplane", "dataplane", "kernels", "protos",
                   "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            old += [f"{path.relative_to(ROOT)}: {name}" for name in imported_modules(path)
                    if name.split(".")[0] in OLD_TOP_LEVEL]
    assert old == []


_NAMES = "|".join(OLD_TOP_LEVEL)
# an import statement's start (a line's, or after ";"), or a module run with -m
_OLD_IN_CODE = re.compile(rf"(?:^|;)\s*(?:import\s+(?:{_NAMES})\b(?!\s*[=:])|from\s+(?:{_NAMES})[.\s])"
                          rf"|-m\s+(?:{_NAMES})\b")


def test_no_script_or_command_line_names_the_old_top_level_packages():
    """Code run from strings (``python -c`` probes) and child command lines (``-m`` NAME) too:
    run from the repository's root they would import its folders as top-level packages, a
    second copy beside ``headrace``'s."""
    found = []
    for folder in ("cli", "client", "common", "controlplane", "dataplane", "kernels", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found += [f"{path.relative_to(ROOT)}: {line.strip()}"
                              for line in node.value.splitlines() if _OLD_IN_CODE.search(line)]
                elif isinstance(node, (ast.List, ast.Tuple)):
                    items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
                    found += [f"{path.relative_to(ROOT)}: -m {b}" for a, b in zip(items, items[1:])
                              if a == "-m" and b in OLD_TOP_LEVEL]
    assert found == []


def test_the_import_check_sees_imports_anywhere_in_a_module(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from headrace.dataplane.worker import Worker\n"
                      "    import torch.cuda\n")
    assert ({"headrace.dataplane.worker", "headrace.dataplane.worker.Worker", "torch.cuda"}
            <= imported_modules(module))


PROBE = BLOCK_TORCH + '''
import importlib
import pkgutil

from headrace import common, controlplane

for package in (common, controlplane):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
from headrace.cli.main import build_parser, cmd_controlplane, cmd_serve, serve_children_argvs
from headrace.cli.configs import engine_config, plane_options
from headrace.cli.options import default_model
from headrace.controlplane.server import ControlPlane, serve_until_signal

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
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import headrace.dataplane.worker\n"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0 and "import of torch refused" in out.stderr


def test_every_package_folder_is_installed_and_copied_into_the_image():
    pyproject = (ROOT / "pyproject.toml").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder, package in PACKAGE_DIRS.items():
        if folder != "protos/headrace":
            assert f'"{package}" = "{folder}"' in pyproject, package
        top = folder.split("/")[0]
        assert f"COPY {top} ./{top}" in dockerfile, top


def test_every_python_package_is_listed_for_installation():
    """A non-editable install (the image) ships only the packages pyproject lists: a new
    subpackage left out of it would be missing there while every test here passes."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    listed = pyproject[pyproject.index("packages = ["):pyproject.index("]", pyproject.index("packages = ["))]
    for folder in PACKAGE_DIRS:
        for init in (ROOT / folder).rglob("__init__.py"):
            assert f'"{module_name(init)}"' in listed, module_name(init)
        for module in (ROOT / folder).rglob("*.py"):   # a folder of modules is a package
            assert (module.parent / "__init__.py").exists(), module.relative_to(ROOT)


def test_the_engine_core_loads_no_api_stack():
    """The core process (``python -m headrace.cli core``) serves no HTTP API: it starts, and
    restarts while its front ends answer UNAVAILABLE, without importing FastAPI, pydantic or
    uvicorn."""
    probe = ("import sys\nimport headrace.cli.main, headrace.cli.roles, "
             "headrace.controlplane.core.server, headrace.controlplane.lifecycle\n"
             "print(sorted(m for m in ('fastapi', 'pydantic', 'uvicorn', 'headrace.controlplane.http.app') "
             "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "[]"
