"""Ranks on other nodes get the weights through the model store into their own node's cache
(strata/model/parallel/weight_source.py). Two cache directories stand for two nodes; ranks
are threads (a node's file lock excludes them as it does processes).

A local model (NFS) is verified once per node and version; a GGUF file is converted once per
node; a path that a node lacks is refused by name. Over S3 (test_s3.py, which has the server):
each node downloads each file once into its own cache, however many of its ranks start at
once, and ranks on rank 0's host use rank 0's files.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from tiny_models import write_tiny_gguf

from strata.errors import ModelLoadError
from strata.model import gguf_cache
from strata.model.parallel.shard_loader import WeightFiles
from strata.model.parallel.weight_source import WeightSource, resolve_on_node
from strata.store import resolve as store_resolve
from strata.store import write_manifest

ONE_FILE = {"*": "model.safetensors"}


def at_once(calls: list[Callable[[], WeightFiles]]) -> list[WeightFiles]:
    """Run `calls` on threads started together; their results in order (errors re-raised)."""
    results: list[WeightFiles | BaseException] = [RuntimeError("not run")] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, WeightFiles)]


def test_a_local_model_is_verified_once_per_node_and_again_when_it_changes(
        tiny_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "nfs" / "tiny"
    shutil.copytree(tiny_dir, model)
    write_manifest(model)
    source = WeightSource(str(model), ONE_FILE, str(tmp_path / "unused"), "float32", host="h")
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    with mock.patch.object(store_resolve, "verify_manifest",
                           wraps=store_resolve.verify_manifest) as verify:
        at_once([lambda: resolve_on_node(source, "a", node_a)] * 3)
        assert verify.call_count == 1
        resolve_on_node(source, "b", node_b)
        assert verify.call_count == 2
        (model / "model.safetensors").write_bytes(b"tampered")
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            resolve_on_node(source, "a", node_a)
        assert verify.call_count == 3


def test_a_gguf_file_is_converted_once_per_node(tiny_dir: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tiny_dir, tmp_path / "tiny.gguf")
    source = WeightSource(str(gguf), {}, str(tmp_path / "unused"), "float32", gguf=gguf.name)
    node_a = tmp_path / "node-a"
    with mock.patch.object(gguf_cache, "_write_cache", wraps=gguf_cache._write_cache) as write:
        got = at_once([lambda: resolve_on_node(source, "a", node_a)] * 2)
    assert write.call_count == 1
    assert got[0] == got[1] and Path(got[0].files["*"]).is_relative_to(node_a / "gguf")


def test_a_path_the_node_lacks_is_refused_by_name(tmp_path: Path) -> None:
    source = WeightSource(str(tmp_path / "only-on-rank-0"), ONE_FILE, str(tmp_path), "float32")
    with pytest.raises(ModelLoadError, match="only-on-rank-0: no such model on this node"):
        resolve_on_node(source, "other", tmp_path / "node")
