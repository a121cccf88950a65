"""Shared model storage: local paths (NFS), `file://` and `s3://` URIs, sha256 manifests, a
local cache filled atomically under a file lock."""

from __future__ import annotations

from strata.store.manifest import (
    MANIFEST_NAME,
    Manifest,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from strata.store.resolve import is_model_uri, resolve_model_uri, verify_local
from strata.store.s3 import S3Config, fetch, parse_s3_uri, push_dir

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "S3Config",
    "fetch",
    "is_model_uri",
    "parse_s3_uri",
    "push_dir",
    "read_manifest",
    "resolve_model_uri",
    "verify_local",
    "verify_manifest",
    "write_manifest",
]
