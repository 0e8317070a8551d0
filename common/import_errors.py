"""A process that cannot import what it needs says so in one line and exits, never with a
traceback and never as a server that reports SERVING and answers nothing: which module is
missing or wrong, where the one Python found comes from, and the fix.

Two failures seen on fresh machines: a data plane whose ``import triton`` failed (CPU torch
wheels do not bring triton) and a module shadowed by another distribution's of the same name
(Hugging Face's ``kernels`` before everything moved under ``headrace``). ``serve`` then said
only that the data plane had exited while loading."""

from __future__ import annotations

import importlib.util
import sys

# the fix for a library that an optional feature needs (pyproject's extras)
FIXES = {
    "triton": "pip install triton (Linux; the CUDA build of torch brings it), or run on the CPU "
              "without it (HEADRACE_KERNELS=reference)",
    "llguidance": "pip install 'headrace[structured]'",
    "xgrammar": "pip install 'headrace[xgrammar]'",
    "flash_attn": "pip install 'headrace[flash-attn]'",
    "gemlite": "pip install 'headrace[gemlite]'",
    "fbgemm_gpu": "pip install 'headrace[fbgemm]' (the wheel of your torch's minor version)",
}


def origin(module: str) -> str:
    """Where ``module`` would be imported from (a file or folder), or why not."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"nowhere ({exc})"
    if spec is None:
        return "nowhere"
    if spec.origin and spec.origin != "namespace":
        return spec.origin
    return ", ".join(spec.submodule_search_locations or []) or "a namespace package"


def import_failure(exc: ImportError) -> str:
    """One line: what could not be imported, from where, and how to fix it."""
    name = exc.name or ""
    top = name.split(".")[0]
    if top == "headrace":
        stray = _namespace_folder(name)
        if stray:   # a folder of ignored files left by an older version, where a package is mapped
            return (f"cannot import {name} ({exc}): the folder {stray} (no __init__.py: a "
                    f"leftover of an older version, holding only ignored files such as "
                    f"__pycache__) stands in for it; remove that folder")
        return (f"cannot import {name} ({exc}); the headrace package Python found "
                f"({origin('headrace')}) is incomplete or not the installed one: reinstall it "
                f"(pip install -e . in the clone) and check PYTHONPATH")
    if isinstance(exc, ModuleNotFoundError) and name:
        fix = FIXES.get(top, f"pip install {top}")
        return f"cannot import {name}: it is not installed in {sys.prefix}; {fix}"
    return (f"{exc}; {top or 'the module'} comes from {origin(top) if top else 'unknown'}, which "
            f"may be another distribution's package of that name or an old version: reinstall "
            f"the one headrace needs")


def _namespace_folder(name: str) -> str | None:
    """The folder standing in for ``name`` or one of its parents as a namespace package (a
    folder without __init__.py that Python found before the installed package), if any."""
    parts = name.split(".")
    for i in range(2, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is not None and getattr(module, "__file__", None) is None:
            return ", ".join(getattr(module, "__path__", [])) or None
    return None
