"""Where a ``--model`` comes from: a local checkpoint directory, or a Hugging Face Hub model id
``org/name[@revision]`` when no local directory has that name. Hub ids resolve through
``huggingface_hub.snapshot_download`` with its cache and settings (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``), fetching only what serving needs
(``*.json``, ``*.safetensors``). Failures are one-line ``ModelSourceError``s saying what to do."""

from __future__ import annotations

import os
import pathlib

ALLOW_PATTERNS = ["*.json", "*.safetensors"]


class ModelSourceError(ValueError):
    """The model is neither a local directory nor a Hub model that can be had."""


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name or name.count("/") != 1


def split_model_id(name: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); no ``@``: revision None (the hub's main)."""
    repo_id, _, revision = name.partition("@")
    return repo_id, revision or None


def resolve_model(name: str, *, revision: str | None = None, token: str | None = None,
                  cache_dir: str | None = None) -> str:
    """The local directory of ``name``: itself when it is a directory, else the snapshot of
    Hub model ``org/name[@revision]`` (downloaded into the cache unless ``HF_HUB_OFFLINE``)."""
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelSourceError(f"--model {name}: is a file; give the checkpoint's directory")
    if _looks_like_path(name):
        raise ModelSourceError(f"--model {name}: no such directory (and not a Hugging Face model "
                               f"id of the form org/name)")
    repo_id, at = split_model_id(name)
    return _snapshot(repo_id, revision or at, token, cache_dir)


def _snapshot(repo_id: str, revision: str | None, token: str | None, cache_dir: str | None) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:   # pragma: no cover  (a dependency of tokenizers)
        raise ModelSourceError(f"--model {repo_id}: no such directory, and huggingface_hub is not "
                               f"installed to fetch it from the Hub") from None
    offline = constants.HF_HUB_OFFLINE
    where = repo_id + (f"@{revision}" if revision else "")
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, token=token,
                                                 cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS)
    except errors.HFValidationError:
        raise ModelSourceError(f"--model {repo_id}: no such directory, and not a valid Hugging Face "
                               f"model id") from None
    except errors.GatedRepoError:
        raise ModelSourceError(f"--model {where}: a gated model; accept its licence on the Hub and "
                               f"set HF_TOKEN") from None
    except errors.RevisionNotFoundError:
        raise ModelSourceError(f"--model {where}: the Hub has no revision {revision!r} of "
                               f"{repo_id}") from None
    except errors.RepositoryNotFoundError:
        raise ModelSourceError(f"--model {where}: no such directory, and no such model on the Hugging "
                               f"Face Hub (a private one needs HF_TOKEN)") from None
    except errors.LocalEntryNotFoundError:
        cache = cache_dir or constants.HF_HUB_CACHE
        if offline:
            raise ModelSourceError(f"--model {where}: not in the Hugging Face cache {cache}, and "
                                   f"HF_HUB_OFFLINE is set; download it where the Hub is reachable "
                                   f"(hf download {repo_id}) or unset HF_HUB_OFFLINE") from None
        raise ModelSourceError(f"--model {where}: the Hugging Face Hub cannot be reached and the "
                               f"model is not in the cache {cache}") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"--model {where}: cannot fetch it from the Hugging Face Hub: "
                               f"{first}") from None


def model_name(model_dir: str | pathlib.Path) -> str:
    """A model's name: ``org/name`` for a snapshot in the Hugging Face cache
    (``models--org--name/snapshots/<commit>``), else the directory's name."""
    path = pathlib.Path(model_dir).resolve()
    repo = path.parent.parent.name
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name


def check_checkpoint(model_dir: str, *, weights: bool = True, tokenizer: bool = True) -> None:
    """ModelSourceError naming the first file serving needs that ``model_dir`` lacks:
    config.json, tokenizer.json (``tokenizer``), *.safetensors (``weights``)."""
    path = pathlib.Path(model_dir)
    if not path.is_dir():
        raise ModelSourceError(f"--model {model_dir}: no such directory")
    what = "a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"--model {model_dir}: no config.json; point --model at {what}")
    if tokenizer and not (path / "tokenizer.json").is_file():
        raise ModelSourceError(f"--model {model_dir}: no tokenizer.json (headrace reads the tokenizers "
                               f"library's tokenizer.json; save one with AutoTokenizer.save_pretrained)")
    if weights and not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"--model {model_dir}: no *.safetensors weights (convert .bin / .pt "
                               f"weights with save_pretrained(safe_serialization=True))")
