"""``--model`` names: local directories, and Hugging Face Hub ids resolved through
huggingface_hub from a local cache laid out as the hub's (models--org--name/snapshots/<rev>,
refs/main), with HF_HOME and HF_HUB_OFFLINE as a user would set them (no hub is reachable
here), and one-line errors for every way it can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from headrace.common.model_source import ModelSourceError, resolve_model, split_model_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN, OLD = "a" * 40, "b" * 40


@pytest.fixture()
def hf_home(tmp_path):
    """HF_HOME with org/tiny cached at two commits: main -> MAIN, tag v1 -> OLD."""
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    for rev, layers in ((MAIN, 2), (OLD, 1)):
        snap = repo / "snapshots" / rev
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
        (snap / "model.safetensors").write_bytes(b"")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(OLD)
    return tmp_path / "hf"


def _resolve(name: str, env: dict) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom headrace.common.model_source import resolve_model, ModelSourceError\n"
            "try: print(resolve_model(sys.argv[1]))\n"
            "except ModelSourceError as e: print(e, file=sys.stderr); sys.exit(3)\n")
    full = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code, name], env=full, capture_output=True,
                          text=True, timeout=60)


def test_hub_ids_resolve_from_the_cache_offline(hf_home):
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    for name, rev, layers in (("org/tiny", MAIN, 2), ("org/tiny@v1", OLD, 1), (f"org/tiny@{OLD}", OLD, 1)):
        out = _resolve(name, env)
        assert out.returncode == 0, out.stderr
        path = out.stdout.strip()
        assert path.endswith(f"snapshots/{rev}")
        assert json.loads(open(os.path.join(path, "config.json")).read())["num_hidden_layers"] == layers


def test_a_model_missing_from_the_cache_offline_is_one_clear_line(hf_home):
    out = _resolve("org/absent", {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 3
    assert out.stderr.count("\n") == 1 and "not in the Hugging Face cache" in out.stderr
    assert "HF_HUB_OFFLINE" in out.stderr and "Traceback" not in out.stderr
    out = _resolve("org/tiny@nope", {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 3 and "org/tiny@nope" in out.stderr


def test_an_unreachable_hub_is_one_clear_line(hf_home):
    out = _resolve("org/absent", {"HF_HOME": str(hf_home), "HF_ENDPOINT": "http://127.0.0.1:9",
                                  "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"})
    assert out.returncode == 3 and out.stderr.count("\n") == 1, out.stderr
    assert "org/absent" in out.stderr and "Traceback" not in out.stderr


def test_local_directories_win_and_bad_paths_are_named(tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == "org/tiny"   # a local directory of that name
    assert resolve_model(str(local)) == str(local)
    with pytest.raises(ModelSourceError, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelSourceError, match="no such directory"):
        resolve_model("./missing")
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="is a file"):
        resolve_model(str(tmp_path / "file.bin"))
    with pytest.raises(ModelSourceError, match="not a valid Hugging Face model id"):
        resolve_model("org/bad name!")
    assert split_model_id("org/name@rev") == ("org/name", "rev")
    assert split_model_id("org/name") == ("org/name", None)


def test_check_checkpoint_names_the_missing_file(tmp_path):
    from headrace.common.model_source import check_checkpoint

    with pytest.raises(ModelSourceError, match="no such directory"):
        check_checkpoint(str(tmp_path / "absent"))
    with pytest.raises(ModelSourceError, match="no config.json"):
        check_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="no tokenizer.json"):
        check_checkpoint(str(tmp_path))
    check_checkpoint(str(tmp_path), tokenizer=False, weights=False)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"no \*.safetensors"):
        check_checkpoint(str(tmp_path))
    check_checkpoint(str(tmp_path), weights=False)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_checkpoint(str(tmp_path))


def test_a_cached_snapshot_is_named_after_its_repository(hf_home, tmp_path):
    from headrace.common.model_source import model_name

    assert model_name(hf_home / "hub" / "models--org--tiny" / "snapshots" / MAIN) == "org/tiny"
    assert model_name(tmp_path) == tmp_path.name
