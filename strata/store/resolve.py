"""Model URIs -> a local path ready to load.

    /abs/or/relative/path, file:///abs/path   used in place, after manifest verification
    s3://bucket/prefix                          downloaded into cache_dir/store/... and verified

A local model without a manifest is served with a warning (plain Hugging Face directories keep
working); a model on S3 must have one.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from urllib.parse import unquote, urlparse

from strata.errors import ConfigError, ModelLoadError
from strata.store.manifest import MANIFEST_NAME, read_manifest, verify_manifest
from strata.store.s3 import S3Config, fetch

log = logging.getLogger("strata.store")
SCHEMES = ("file", "s3")


def is_model_uri(model: str) -> bool:
    """True for `file://` and `s3://` URIs (what `strata serve` hands to `resolve_model_uri`)."""
    return model.startswith(("file://", "s3://"))


def resolve_model_uri(uri: str, *, cache_dir: Path, s3_endpoint_url: str | None = None,
                      s3_config: S3Config | None = None, progress: bool = True) -> Path:
    """A verified local directory (or file) for `uri`.

    `s3_config` carries credentials and the endpoint; `s3_endpoint_url`, when given, overrides
    its endpoint. Raises `ModelLoadError` for a missing, partial or corrupt file.
    """
    scheme = urlparse(uri).scheme if "://" in uri else ""
    if scheme == "s3":
        config = s3_config or S3Config()
        if s3_endpoint_url is not None:
            config = replace(config, endpoint_url=s3_endpoint_url)
        return fetch(uri, cache_dir=cache_dir, config=config, progress=progress)
    if scheme == "file":
        return verify_local(Path(unquote(urlparse(uri).path)))
    if scheme:
        raise ConfigError(f"{uri!r}: unknown scheme {scheme!r}; use a path, "
                          + ", ".join(f"{s}://" for s in SCHEMES))
    return verify_local(Path(uri))


def verify_local(path: Path) -> Path:
    """Check a local model directory or file against its manifest; return the path."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model directory or file")
    model_dir = path if path.is_dir() else path.parent
    manifest = read_manifest(model_dir)
    if manifest is None:
        log.warning("%s has no %s: serving it unverified (create one with "
                    "`strata store manifest %s`)", model_dir, MANIFEST_NAME, model_dir)
        return path
    if path.is_dir():
        verify_manifest(model_dir, manifest)
    else:
        verify_manifest(model_dir, manifest, only=[path.name])
    log.info("verified %d files of %s against %s", len(manifest.files), model_dir, MANIFEST_NAME)
    return path
