"""Models on a real S3-compatible server (moto, loopback): push, fetch, verify, share a cache;
the ranks of a parallel instance on two nodes fetch into each node's cache once."""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest
import torch
from s3_server import DUMMY, CountingMotoServer
from test_node_cache import ONE_FILE, at_once

from strata.errors import ModelLoadError
from strata.model.loader import load_model
from strata.model.parallel.shard_loader import WeightFiles
from strata.model.parallel.weight_source import WeightSource, resolve_on_node
from strata.store import MANIFEST_NAME, S3Config, push_dir, read_manifest, resolve_model_uri
from strata.store.s3 import make_client

MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json"]


def _push(tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str) -> str:
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    uri = f"s3://{bucket}/models/tiny"
    push_dir(src, uri, s3, progress=False)
    return uri


def _gets(server: CountingMotoServer, bucket: str, name: str) -> int:
    return server.gets(f"/{bucket}/models/tiny/{name}")


def test_push_fetch_and_load_gives_the_same_weights(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str,
        s3_server: CountingMotoServer) -> None:
    uri = _push(tiny_dir, tmp_path, s3, bucket)
    path = resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3, progress=False)
    assert path.parent.parent == tmp_path / "cache" / "store" / bucket
    assert path.name == "tiny"  # the model's name, as load_model reports it
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [".lock", ".verified", MANIFEST_NAME, *MODEL_FILES])
    assert [_gets(s3_server, bucket, n) for n in MODEL_FILES] == [1] * len(MODEL_FILES)
    fetched, local = load_model(path, dtype="float32"), load_model(tiny_dir, dtype="float32")
    assert fetched.name == "tiny"
    assert fetched.weights.keys() == local.weights.keys()
    assert all(torch.equal(fetched.weights[k], local.weights[k]) for k in local.weights)
    # a second start finds the verified cache: it reads the manifest, nothing else
    assert resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3,
                             progress=False) == path
    assert [_gets(s3_server, bucket, n) for n in MODEL_FILES] == [1] * len(MODEL_FILES)
    assert _gets(s3_server, bucket, MANIFEST_NAME) == 2


def test_a_corrupted_object_of_the_same_size_is_refused(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str) -> None:
    uri = _push(tiny_dir, tmp_path, s3, bucket)
    good = (tiny_dir / "model.safetensors").read_bytes()
    bad = good[:-8] + bytes(8) if good[-8:] != bytes(8) else good[:-8] + b"x" * 8
    make_client(s3).put_object(Bucket=bucket, Key="models/tiny/model.safetensors", Body=bad)
    expected = read_manifest(tmp_path / "src")
    assert expected is not None
    with pytest.raises(ModelLoadError) as e:
        resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3, progress=False)
    message = str(e.value)
    assert message.startswith(f"{uri}/model.safetensors: sha256 ")
    assert f"expected {expected.files['model.safetensors'].sha256}" in message
    assert "corrupt object" in message
    cached = next((tmp_path / "cache" / "store" / bucket).iterdir()) / "tiny"
    assert not (cached / "model.safetensors").exists()  # never renamed into place
    assert not (cached / ".verified").exists()
    assert [p.name for p in cached.iterdir() if p.name.startswith(".model")] == []


def test_a_truncated_object_is_refused(tiny_dir: Path, tmp_path: Path, s3: S3Config,
                                       bucket: str) -> None:
    uri = _push(tiny_dir, tmp_path, s3, bucket)
    full = (tiny_dir / "tokenizer.json").read_bytes()
    make_client(s3).put_object(Bucket=bucket, Key="models/tiny/tokenizer.json", Body=full[:100])
    with pytest.raises(ModelLoadError, match=rf"^{uri}/tokenizer.json: downloaded 100 bytes, "
                                             rf"expected {len(full)} from the manifest"):
        resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3, progress=False)


def test_two_instances_starting_at_once_download_each_file_once(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str,
        s3_server: CountingMotoServer) -> None:
    uri = _push(tiny_dir, tmp_path, s3, bucket)
    paths: list[Path] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            paths.append(resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3,
                                           progress=False))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(paths) == 3 and len(set(paths)) == 1
    assert [_gets(s3_server, bucket, n) for n in MODEL_FILES] == [1] * len(MODEL_FILES)
    assert _gets(s3_server, bucket, MANIFEST_NAME) == 3


def test_a_new_remote_version_replaces_only_changed_files(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str,
        s3_server: CountingMotoServer) -> None:
    uri = _push(tiny_dir, tmp_path, s3, bucket)
    path = resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3, progress=False)
    (tmp_path / "src" / "config.json").write_text('{"changed": true}')
    (tmp_path / "src" / MANIFEST_NAME).unlink()  # push writes a fresh one
    push_dir(tmp_path / "src", uri, s3, progress=False)
    assert resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=s3,
                             progress=False) == path
    assert (path / "config.json").read_text() == '{"changed": true}'
    assert _gets(s3_server, bucket, "config.json") == 2
    assert _gets(s3_server, bucket, "model.safetensors") == 1


def test_a_model_on_s3_needs_a_manifest(tmp_path: Path, s3: S3Config, bucket: str) -> None:
    make_client(s3).put_object(Bucket=bucket, Key="bare/config.json", Body=b"{}")
    with pytest.raises(ModelLoadError, match=r"manifest.*strata store push DIR s3://"):
        resolve_model_uri(f"s3://{bucket}/bare", cache_dir=tmp_path, s3_config=s3,
                          progress=False)


def test_the_endpoint_flag_overrides_the_configured_endpoint(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str) -> None:
    uri = _push(tiny_dir, tmp_path, s3, bucket)
    unreachable = dataclasses.replace(s3, endpoint_url="http://127.0.0.1:9")  # discard port
    path = resolve_model_uri(uri, cache_dir=tmp_path / "cache", s3_config=unreachable,
                             s3_endpoint_url=s3.endpoint_url, progress=False)
    assert sorted(p.name for p in path.iterdir() if p.name in MODEL_FILES) == sorted(MODEL_FILES)


def test_each_node_fetches_each_file_once_into_its_own_cache(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str,
        s3_server: CountingMotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY.secret_access_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", DUMMY.region_name)
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    uri = f"s3://{bucket}/models/tiny"
    push_dir(src, uri, s3, progress=False)
    source = WeightSource(uri, ONE_FILE, str(tmp_path / "unused"), "float32",
                          s3_endpoint_url=s3.endpoint_url, host="head",
                          prepared=WeightFiles({"*": str(src / "model.safetensors")}))
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    got = at_once([lambda: resolve_on_node(source, "a", node_a),
                    lambda: resolve_on_node(source, "a", node_a),
                    lambda: resolve_on_node(source, "b", node_b)])
    a1, a2, b = (Path(w.files["*"]) for w in got)
    assert a1 == a2 and a1.is_relative_to(node_a) and b.is_relative_to(node_b)
    assert a1.read_bytes() == b.read_bytes() == (src / "model.safetensors").read_bytes()
    assert s3_server.gets(f"/{bucket}/models/tiny/model.safetensors") == 2  # once per node
    assert resolve_on_node(source, "head") == source.prepared  # rank 0's host: its own files
