"""Local model directories and file:// URIs: verified in place against their manifest."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from strata.errors import ConfigError, ModelLoadError
from strata.store import MANIFEST_NAME, resolve_model_uri, write_manifest
from strata.store.manifest import local_manifest_sha256, manifest_digest, sha256_file


@pytest.fixture
def model_dir(tiny_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_dir, copy)
    return copy


def test_manifest_lists_every_file_with_size_and_sha256(model_dir: Path) -> None:
    (model_dir / "sub").mkdir()
    (model_dir / "sub" / "extra.txt").write_text("hello")
    write_manifest(model_dir)
    data = json.loads((model_dir / MANIFEST_NAME).read_text())
    assert data["format"] == 1
    assert sorted(data["files"]) == sorted([
        "config.json", "generation_config.json", "model.safetensors", "sub/extra.txt",
        "tokenizer.json", "tokenizer_config.json"])
    assert data["files"]["sub/extra.txt"] == {
        "size": 5, "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"}
    weights = model_dir / "model.safetensors"
    assert data["files"]["model.safetensors"] == {"size": weights.stat().st_size,
                                                   "sha256": sha256_file(weights)}


def test_a_verified_directory_is_used_in_place(model_dir: Path, tmp_path: Path) -> None:
    write_manifest(model_dir)
    assert resolve_model_uri(str(model_dir), cache_dir=tmp_path / "cache") == model_dir
    assert resolve_model_uri(f"file://{model_dir}", cache_dir=tmp_path / "cache") == model_dir
    assert not (tmp_path / "cache").exists()


def test_a_corrupt_file_of_the_same_size_is_refused(model_dir: Path, tmp_path: Path) -> None:
    write_manifest(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        resolve_model_uri(f"file://{model_dir}", cache_dir=tmp_path)
    assert str(e.value).startswith("model.safetensors: sha256 ")
    assert f"expected {_listed(model_dir, 'model.safetensors')['sha256']}" in str(e.value)
    assert "corrupt" in str(e.value)


def test_a_truncated_file_is_refused_with_both_sizes(model_dir: Path, tmp_path: Path) -> None:
    write_manifest(model_dir)
    size = (model_dir / "tokenizer.json").stat().st_size
    with (model_dir / "tokenizer.json").open("r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ModelLoadError, match=rf"^tokenizer.json: size {size - 10} bytes, "
                                             rf"expected {size} from the manifest"):
        resolve_model_uri(str(model_dir), cache_dir=tmp_path)


def test_a_missing_file_is_refused(model_dir: Path, tmp_path: Path) -> None:
    write_manifest(model_dir)
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"^config.json: missing"):
        resolve_model_uri(str(model_dir), cache_dir=tmp_path)


def test_a_directory_without_manifest_is_served_with_a_warning(
        model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="strata.store"):
        assert resolve_model_uri(str(model_dir), cache_dir=tmp_path) == model_dir
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert f"{model_dir} has no {MANIFEST_NAME}" in caplog.records[0].getMessage()


def test_a_single_file_is_checked_against_its_directory_manifest(
        model_dir: Path, tmp_path: Path) -> None:
    write_manifest(model_dir)
    weights = model_dir / "model.safetensors"
    assert resolve_model_uri(str(weights), cache_dir=tmp_path) == weights
    (model_dir / "config.json").write_text("{}")  # another file's damage does not matter here
    assert resolve_model_uri(str(weights), cache_dir=tmp_path) == weights


def test_unknown_schemes_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown scheme 'gs'; use a path, file://, s3://"):
        resolve_model_uri("gs://bucket/model", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match=r"no such model directory or file"):
        resolve_model_uri(str(tmp_path / "nope"), cache_dir=tmp_path)


def _listed(model_dir: Path, name: str) -> dict[str, object]:
    files: dict[str, dict[str, object]] = json.loads(
        (model_dir / MANIFEST_NAME).read_text())["files"]
    return files[name]


def test_the_registered_digest_is_the_local_manifests(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"w")
    assert local_manifest_sha256(str(tmp_path)) == ""  # no manifest yet
    write_manifest(tmp_path)
    digest = manifest_digest((tmp_path / MANIFEST_NAME).read_bytes())
    assert local_manifest_sha256(str(tmp_path)) == digest
    assert local_manifest_sha256(f"file://{tmp_path}") == digest
    assert local_manifest_sha256(str(tmp_path / "weights.bin")) == digest
    assert local_manifest_sha256("s3://bucket/model") == ""
    assert local_manifest_sha256("sim:smollm2-cpu") == ""
