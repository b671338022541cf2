"""The weights' identity: new content gives a new digest, other spellings of one directory give the same one,
and a restart reads no weight file again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_tiercache.shared.naming import weights_identity
from vllm_tiercache.shared.naming.weights_identity import (
    DIGEST_CACHE_NAME,
    digest_directory,
    model_names,
    resolve_weights,
)


def _model(directory: Path, seed: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (directory / "model.safetensors").write_bytes(bytes((seed * 7 + i) % 251 for i in range(4096)))
    return directory


def test_rewritten_weights_in_the_same_directory_change_the_digest(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", seed=1)
    before = resolve_weights(str(model), cache_dir=tmp_path / "cache")
    stat = (model / "model.safetensors").stat()
    _model(model, seed=2)  # same path, same config, same size
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even the same mtime
    after = resolve_weights(str(model), cache_dir=tmp_path / "cache")
    assert before.name == after.name == "m"
    assert before.digest != after.digest
    assert after.digest.startswith("files:") and after.nbytes == 4096 + len('{"hidden_size": 64}')


def test_spellings_of_one_directory_share_the_identity(tmp_path: Path) -> None:
    model = _model(tmp_path / "models" / "x", seed=1)
    link = tmp_path / "link"
    link.symlink_to(model)
    ids = {resolve_weights(s, cache_dir=tmp_path / "cache") for s in (str(model), f"{model}/", str(link))}
    assert len(ids) == 1


def test_readme_edits_and_hidden_files_do_not_change_the_digest(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", seed=1)
    before = digest_directory(model, cache_dir=tmp_path / "cache")
    (model / "README.md").write_text("new docs")
    (model / ".cache").mkdir()
    (model / ".cache" / "x").write_text("download state")
    assert digest_directory(model, cache_dir=tmp_path / "cache") == before
    (model / "extra_weights.safetensors").write_bytes(b"\x01" * 8)
    assert digest_directory(model, cache_dir=tmp_path / "cache") != before


def test_a_restart_reads_no_weight_file_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tmp_path / "m", seed=1)
    first = digest_directory(model, cache_dir=tmp_path / "cache")
    assert (tmp_path / "cache" / DIGEST_CACHE_NAME).exists()
    read: list[str] = []
    real = weights_identity._digest_file
    monkeypatch.setattr(weights_identity, "_digest_file", lambda p: read.append(p) or real(p))
    assert digest_directory(model, cache_dir=tmp_path / "cache") == first
    assert read == []
    (model / "config.json").write_text(json.dumps({"hidden_size": 128}))
    assert digest_directory(model, cache_dir=tmp_path / "cache") != first
    assert read == [str((model / "config.json").resolve())]


def test_a_damaged_digest_cache_is_only_a_cache(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", seed=1)
    first = digest_directory(model, cache_dir=tmp_path / "cache")
    (tmp_path / "cache" / DIGEST_CACHE_NAME).write_text("{not json")
    assert digest_directory(model, cache_dir=tmp_path / "cache") == first


def test_hub_snapshot_directory_is_named_by_its_repo(tmp_path: Path) -> None:
    snapshot = _model(tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / ("a" * 40), seed=1)
    identity = resolve_weights(str(snapshot), cache_dir=tmp_path / "cache")
    assert identity.name == "org/tiny-llama"


def test_model_version_replaces_the_digest_and_unknown_models_say_so(tmp_path: Path) -> None:
    model = _model(tmp_path / "m", seed=1)
    versioned = resolve_weights(str(model), model_version="2026-11-23", cache_dir=tmp_path / "cache")
    assert versioned.digest == "version:2026-11-23" and versioned.nbytes == 0
    assert not (tmp_path / "cache").exists()  # no file read, nothing remembered
    hub = resolve_weights("org/not-downloaded", hub_commit="b" * 40, cache_dir=tmp_path / "cache")
    assert hub.digest == "hf-commit:" + "b" * 40 and hub.verified
    unknown = resolve_weights("org/not-downloaded", cache_dir=tmp_path / "cache")
    assert unknown.name == "org/not-downloaded" and not unknown.verified


def test_an_empty_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        resolve_weights(str(tmp_path / "empty"), cache_dir=tmp_path / "cache")


def test_evict_names_cover_every_spelling_and_old_keys(tmp_path: Path) -> None:
    model = _model(tmp_path / "models" / "x", seed=1)
    link = tmp_path / "link"
    link.symlink_to(model)
    for spelling in (str(model), f"{model}/", str(link)):
        assert "x" in model_names(spelling) and spelling in model_names(spelling)
    assert "gone" in model_names(str(tmp_path / "gone"))  # a path whose weights were removed
    assert model_names("org/name") == {"org/name"}


def test_the_digest_cache_forgets_files_that_are_gone(tmp_path: Path) -> None:
    old = _model(tmp_path / "old", seed=1)
    digest_directory(old, cache_dir=tmp_path / "cache")
    for f in old.iterdir():
        f.unlink()
    digest_directory(_model(tmp_path / "new", seed=2), cache_dir=tmp_path / "cache")
    remembered = json.loads((tmp_path / "cache" / DIGEST_CACHE_NAME).read_text())["files"]
    assert remembered and all(str(tmp_path / "new") in path for path in remembered)
