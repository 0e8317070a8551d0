"""Where Admin's ``ReloadModel`` may load a model from: directories under the allowed model
roots, ``--model-root`` (repeatable), by default the directory holding the model served at
start and the Hugging Face hub cache; the model served at start is always allowed (reloading it
back). A path is resolved (``..`` and symbolic links followed,
without touching the file system beyond that) before it is compared, and every path outside
the roots gets the same refusal, whether or not it exists: Admin cannot be used to learn which
files a machine has."""

from __future__ import annotations

import os


def hub_cache() -> str:
    """The Hugging Face hub cache (``HF_HUB_CACHE``, else under ``HF_HOME``)."""
    try:
        from huggingface_hub import constants
    except ImportError:   # pragma: no cover - huggingface_hub is a dependency
        return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    return constants.HF_HUB_CACHE


def roots_for(model_dir: str, given: list[str] | None = None) -> list[str]:
    """``given`` (default: the served model's parent directory and the hub cache), and the
    served model's own directory."""
    real = os.path.realpath(model_dir)
    return list(given or [os.path.dirname(real), hub_cache()]) + [real]


def allowed(path: str, roots: list[str]) -> bool:
    """Whether ``path`` resolves to one of ``roots`` or below it."""
    real = os.path.realpath(os.path.expanduser(path))
    for root in roots:
        root = os.path.realpath(os.path.expanduser(root))
        if os.path.commonpath([real, root]) == root:
            return True
    return False


def refusal(path: str) -> str:
    return (f"model {path!r} is not under an allowed model root (the server's --model-root; "
            "by default the directory holding the model served at start, and the Hugging "
            "Face cache)")
