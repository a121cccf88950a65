"""Where a rank finds the weights: through the model store, on its own node.

Rank 0 prepares the model (shard_loader.prepare_model) and sends each rank a `WeightSource`:
the model as the store names it (a path on every node's filesystem or NFS, `file://`, `s3://`
with its sha256 manifest, or a known alias), the tensor -> file map relative to the resolved
model, and the node cache. Each rank on another node than rank 0 resolves it there
(`resolve_on_node`) into that node's cache, verified, then converts a GGUF file into the node's
safetensors cache: no rank reads a path of rank 0's filesystem (ranks on rank 0's node use what
rank 0 prepared and verified). The ranks of one node share the work through a file lock
per model in the node cache: the first fetches (or verifies, or converts) and leaves a marker of
what it checked; the others wait on the lock and find the marker, so a node fetches and
verifies each model version once.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from strata.errors import ModelLoadError
from strata.model.parallel.shard_loader import PreparedModel, WeightFiles
from strata.store.locks import file_lock

NODE_LOCKS = "node-locks"


@dataclass(frozen=True, slots=True)
class WeightSource:
    """How a rank on any node gets the weights (picklable; the same on every rank).

    `files` maps tensor names to files relative to the resolved model (`"*"`: one file holds
    them all); `gguf` names a GGUF file (relative too), converted on the node into `dtype`.
    `cache_dir` is the node cache: the same path on each node, on that node's disk."""

    uri: str
    files: dict[str, str]
    cache_dir: str
    dtype: str
    gguf: str | None = None
    s3_endpoint_url: str | None = None
    host: str = ""  # rank 0's host id
    prepared: WeightFiles | None = None  # rank 0's files: for ranks on its host only


def source_of(model: PreparedModel, *, dtype: str, host: str) -> WeightSource:
    """What the ranks of `model` get, rank 0 being on `host`. Without a cache directory (an HF
    directory needs none on rank 0's node) the nodes lock and mark in a temporary one."""
    src = model.source
    if src.is_dir():
        root = src.resolve()
        files = {name: str(Path(file).resolve().relative_to(root))
                 for name, file in model.weights.files.items()}
        gguf = None
    else:
        files, gguf = {}, src.name
    cache = model.cache_dir or Path(tempfile.gettempdir()) / "strata-node-cache"
    return WeightSource(model.uri or str(src.resolve()), files, str(cache), dtype, gguf,
                        model.s3_endpoint_url, host, model.weights)


def resolve_on_node(source: WeightSource, host: str, cache_dir: Path | None = None
                    ) -> WeightFiles:
    """The weights for a rank on `host` (a host id): rank 0's prepared files on its host;
    elsewhere this node's verified copy (fetched, verified or converted now unless this node
    already did it for this version). `cache_dir` overrides the source's (tests: two
    directories stand for two nodes)."""
    if host == source.host and source.prepared is not None:
        return source.prepared
    cache = Path(cache_dir or source.cache_dir)
    with node_lock(cache, source.uri):
        root = _resolve_once(source, cache)
        if source.gguf is not None:
            return WeightFiles({"*": str(_convert(root / source.gguf, source.dtype, cache))})
    return WeightFiles({name: str(root / file) for name, file in source.files.items()})


@contextmanager
def node_lock(cache: Path, key: str) -> Iterator[None]:
    """An exclusive lock on `key` in this node's cache: ranks of one node take turns."""
    lock = cache / NODE_LOCKS / f"{_digest(key)}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock):
        yield


def _resolve_once(source: WeightSource, cache: Path) -> Path:
    """The model's root on this node. s3:// caches its own verified marker (store/s3.py); a
    local model is verified once per version: the marker holds the sizes and mtimes of its
    files and manifest, so a changed file is verified again."""
    from strata.model.fetch import resolve_model
    from strata.store import is_model_uri, resolve_model_uri

    uri = source.uri
    if uri.startswith("s3://"):
        return resolve_model_uri(uri, cache_dir=cache, s3_endpoint_url=source.s3_endpoint_url,
                                 progress=False)
    if not is_model_uri(uri) and not Path(uri).exists() and "/" not in uri:
        return resolve_model(uri, cache_dir=cache, progress=False)  # an alias: pulled here
    path = Path(uri.removeprefix("file://"))
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model on this node; serve ranks on several "
                             "nodes from the model store (s3://) or a path every node mounts")
    root = path if path.is_dir() else path.parent
    marker = cache / NODE_LOCKS / f"{_digest(uri)}.verified"
    stamp = _stamp(root)
    if not (marker.is_file() and marker.read_text() == stamp):
        resolve_model_uri(uri, cache_dir=cache, progress=False)  # verifies against the manifest
        marker.write_text(stamp)
    return root


def _stamp(root: Path) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return json.dumps([(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns)
                       for p in files])


def _convert(gguf: Path, dtype: str, cache: Path) -> Path:
    from strata.model.gguf_cache import convert_gguf
    from strata.model.loader import torch_dtype_of

    return convert_gguf(gguf, dtype=torch_dtype_of(dtype), cache_dir=cache)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]
