"""Model manifests: the size and sha256 of every file of a model, verified before serving.

`strata-manifest.json` sits next to the model files:

    {"format": 1, "files": {"relative/name": {"size": N, "sha256": "hex"}}}

A missing, partial or corrupt file is refused with `ModelLoadError` naming the file and what
differs (expected against actual size or hash).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from strata.errors import ModelLoadError

MANIFEST_NAME = "strata-manifest.json"
VERIFIED_MARKER = ".verified"
MANIFEST_FORMAT = 1
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a model directory must hold: relative POSIX name -> size and sha256."""

    files: dict[str, FileEntry]

    def to_json(self) -> str:
        files = {name: {"size": e.size, "sha256": e.sha256}
                 for name, e in sorted(self.files.items())}
        return json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str) -> Manifest:
        """Parse manifest text; errors name `source`."""
        try:
            data = json.loads(text)
            if data.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format must be {MANIFEST_FORMAT}, got {data.get('format')!r}")
            files = {str(name): FileEntry(int(e["size"]), str(e["sha256"]))
                     for name, e in data["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{source}: not a valid {MANIFEST_NAME}: {e}") from None
        for name in files:
            _check_relative(name, source)
        return cls(files)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())


def _check_relative(name: str, source: str) -> None:
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise ModelLoadError(f"{source}: file name {name!r} must be relative, without '..'")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def model_files(model_dir: Path) -> Iterable[Path]:
    """The files a manifest covers: every regular file except the manifest and hidden files."""
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name != MANIFEST_NAME and not name.startswith("."):
                yield Path(root) / name


def build_manifest(model_dir: Path) -> Manifest:
    """Hash every file of `model_dir`."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory")
    files = {p.relative_to(model_dir).as_posix(): FileEntry(p.stat().st_size, sha256_file(p))
             for p in model_files(model_dir)}
    if not files:
        raise ModelLoadError(f"{model_dir}: no files to put in a manifest")
    return Manifest(files)


def write_manifest(model_dir: Path) -> Path:
    """Write `strata-manifest.json` for the files of `model_dir` (atomically); return its path."""
    manifest = build_manifest(model_dir)
    path = model_dir / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_manifest(model_dir: Path) -> Manifest | None:
    """The manifest of `model_dir`, or None when it has none."""
    path = model_dir / MANIFEST_NAME
    if not path.is_file():
        return None
    return Manifest.from_json(path.read_bytes(), source=str(path))


def verify_file(path: Path, entry: FileEntry, *, name: str) -> None:
    """Raise `ModelLoadError` unless `path` has the size and sha256 of `entry`."""
    if not path.is_file():
        raise ModelLoadError(f"{name}: missing (the manifest lists {entry.size} bytes) at {path}")
    size = path.stat().st_size
    if size != entry.size:
        raise ModelLoadError(f"{name}: size {size} bytes, expected {entry.size} from the "
                             f"manifest (partial or wrong file at {path})")
    digest = sha256_file(path)
    if digest != entry.sha256:
        raise ModelLoadError(f"{name}: sha256 {digest}, expected {entry.sha256} from the "
                             f"manifest (corrupt file at {path})")


def verify_manifest(model_dir: Path, manifest: Manifest | None = None,
                    *, only: Iterable[str] | None = None) -> Manifest:
    """Check every file (or those named in `only`) against the manifest of `model_dir`."""
    manifest = manifest or read_manifest(model_dir)
    if manifest is None:
        raise ModelLoadError(f"{model_dir}: no {MANIFEST_NAME}; create it with "
                             f"`strata store manifest {model_dir}`")
    names = list(manifest.files) if only is None else list(only)
    for name in names:
        if name not in manifest.files:
            raise ModelLoadError(f"{name}: not listed in {model_dir / MANIFEST_NAME}")
        verify_file(model_dir / name, manifest.files[name], name=name)
    return manifest


def manifest_digest(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()


def local_manifest_sha256(uri: str) -> str:
    """The sha256 of a local model's manifest (a directory, a file in it, or file://...);
    "" without one, and for remote storage (checked against its manifest when pulled)."""
    path = Path(uri[len("file://"):] if uri.startswith("file://") else uri)
    if "://" in uri and not uri.startswith("file://") or not path.exists():
        return ""
    manifest = (path if path.is_dir() else path.parent) / MANIFEST_NAME
    return manifest_digest(manifest.read_bytes()) if manifest.is_file() else ""
