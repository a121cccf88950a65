"""Models on S3 (or any S3-compatible server): push a directory, fetch it into a local cache.

A fetch holds an exclusive `flock` on the cache directory, so several instances starting at once
download once: the others wait, then find a verified cache. Each file is streamed to a temporary
name while its sha256 is computed, checked against the manifest, then renamed into place; a
`.verified` marker records the sha256 of the manifest that the whole directory was checked
against, so a later start with the same remote manifest downloads nothing.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.errors import ConfigError, ModelLoadError
from strata.progress import Progress, progress
from strata.store.locks import file_lock
from strata.store.manifest import (
    MANIFEST_NAME,
    VERIFIED_MARKER,
    FileEntry,
    Manifest,
    manifest_digest,
    model_files,
    read_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class S3Config:
    """How to reach S3. Unset credentials come from boto3's usual chain."""

    endpoint_url: str | None = None
    region_name: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str  # without leading or trailing '/'

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def parse_s3_uri(uri: str) -> S3Location:
    """`s3://bucket/prefix` -> S3Location."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{uri!r} is not an s3:// URI (expected s3://bucket/prefix)")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ConfigError(f"{uri!r} names no bucket (expected s3://bucket/prefix)")
    return S3Location(bucket, prefix.strip("/"))


def make_client(config: S3Config) -> Any:
    import boto3

    session = boto3.session.Session(aws_access_key_id=config.access_key_id,
                                    aws_secret_access_key=config.secret_access_key,
                                    region_name=config.region_name or "us-east-1")
    return session.client("s3", endpoint_url=config.endpoint_url)


def cache_path(cache_dir: Path, location: S3Location) -> Path:
    """`cache_dir/store/<bucket>/<prefix-hash>/<last prefix part>/`: the last part keeps the
    model's own name as the directory name (the default served name)."""
    digest = hashlib.sha256(location.prefix.encode()).hexdigest()[:16]
    name = location.prefix.rpartition("/")[2] or location.bucket
    return cache_dir / "store" / location.bucket / digest / name


def push_dir(model_dir: Path, uri: str, config: S3Config, *, progress: bool = True) -> Manifest:
    """Upload `model_dir` and its manifest (written if absent, verified if present).

    The manifest goes last, so a reader never sees a manifest whose files are not all there.
    """
    if read_manifest(model_dir) is None:
        write_manifest(model_dir)
    manifest = verify_manifest(model_dir)
    location, client = parse_s3_uri(uri), make_client(config)
    with _bar(manifest.total_bytes, f"push {location}", progress) as bar:
        for name in manifest.files:
            client.upload_file(str(model_dir / name), location.bucket, location.key(name),
                               Callback=bar.update)
    client.upload_file(str(model_dir / MANIFEST_NAME), location.bucket,
                       location.key(MANIFEST_NAME))
    return manifest


def fetch(uri: str, *, cache_dir: Path, config: S3Config, progress: bool = True) -> Path:
    """Download `s3://bucket/prefix` into the cache unless already there and verified."""
    location, client = parse_s3_uri(uri), make_client(config)
    target = cache_path(cache_dir, location)
    target.mkdir(parents=True, exist_ok=True)
    with file_lock(target / ".lock"):
        manifest_bytes = _get_manifest(client, location)
        digest = manifest_digest(manifest_bytes)
        if _marker(target) == digest:
            return target
        manifest = Manifest.from_json(manifest_bytes, source=f"{location}/{MANIFEST_NAME}")
        _download_missing(client, location, manifest, target, progress)
        _write_atomic(target / MANIFEST_NAME, manifest_bytes)
        _remove_stale(target, manifest)
        _write_atomic(target / VERIFIED_MARKER, digest.encode())
    return target


def _get_manifest(client: Any, location: S3Location) -> bytes:
    from botocore.exceptions import ClientError

    key = location.key(MANIFEST_NAME)
    try:
        body: bytes = client.get_object(Bucket=location.bucket, Key=key)["Body"].read()
    except ClientError as e:
        raise ModelLoadError(
            f"{location}/{MANIFEST_NAME}: cannot read the manifest ({e}); a model on S3 needs "
            f"one: upload it with `strata store push DIR {location}`") from None
    return body


def _marker(target: Path) -> str | None:
    marker = target / VERIFIED_MARKER
    return marker.read_text().strip() if marker.is_file() else None


def _download_missing(client: Any, location: S3Location, manifest: Manifest, target: Path,
                      progress: bool) -> None:
    (target / VERIFIED_MARKER).unlink(missing_ok=True)
    with _bar(manifest.total_bytes, f"fetch {location}", progress) as bar:
        for name, entry in manifest.files.items():
            path = target / name
            if _is_complete(path, entry):
                bar.update(entry.size)
                continue
            _download_file(client, location, name, entry, path, bar)


def _is_complete(path: Path, entry: FileEntry) -> bool:
    return (path.is_file() and path.stat().st_size == entry.size
            and sha256_file(path) == entry.sha256)


def _download_file(client: Any, location: S3Location, name: str, entry: FileEntry,
                   path: Path, bar: Any) -> None:
    """Stream one object to a temporary name, check size and sha256, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}")
    h, size = hashlib.sha256(), 0
    try:
        body = client.get_object(Bucket=location.bucket, Key=location.key(name))["Body"]
        with tmp.open("wb") as f:
            for chunk in body.iter_chunks(_CHUNK_BYTES):
                h.update(chunk)
                f.write(chunk)
                size += len(chunk)
                bar.update(len(chunk))
        _check_download(f"{location}/{name}", entry, size, h.hexdigest())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_download(what: str, entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.size:
        raise ModelLoadError(f"{what}: downloaded {size} bytes, expected {entry.size} from the "
                             "manifest (truncated or wrong object); refusing to serve it")
    if digest != entry.sha256:
        raise ModelLoadError(f"{what}: sha256 {digest}, expected {entry.sha256} from the "
                             "manifest (corrupt object); refusing to serve it")


def _remove_stale(target: Path, manifest: Manifest) -> None:
    """Files left by an older version of the model would be loaded with the new ones."""
    for path in list(model_files(target)):
        if path.relative_to(target).as_posix() not in manifest.files:
            path.unlink()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _bar(total: int, desc: str, enabled: bool) -> Progress:
    return progress(total, desc, unit="B", enabled=enabled)
