"""The write rules every ModelRegistry backend applies, so the three behave the same.

    stamp_version(v, now)                   created_at = v.created_at, else now
    next_revision(record, expected, now)    the record as stored: revision + 1, updated_at = now
    stale(...), already_added(...), ...     the ConflictError messages (what to do next)

Backends decide *whether* a write may happen (atomically, in their own way); these functions
decide *what* is written and what the loser is told.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from strata.errors import ConfigError, ConflictError
from strata.registry.leases import Lease
from strata.registry.models.base import Deployment, ModelRouting, ModelVersion, Release

Revisioned = TypeVar("Revisioned", ModelRouting, Deployment, Release, Lease)


def stamp_version(version: ModelVersion, now: float) -> ModelVersion:
    """`version` as stored: a created_at the caller left at 0 becomes `now`."""
    return version if version.created_at else replace(version, created_at=now)


def same_version(a: ModelVersion, b: ModelVersion) -> bool:
    """Equal apart from created_at (re-adding a version does not restamp it)."""
    return replace(a, created_at=0.0) == replace(b, created_at=0.0)


def check_expected(expected_revision: int) -> None:
    if expected_revision < 0:
        raise ConfigError(f"expected_revision must be >= 0 (0 = create), got {expected_revision}")


def next_revision(record: Revisioned, expected_revision: int, now: float) -> Revisioned:
    """`record` as stored by a CAS write that read `expected_revision`. A release keeps the
    created_at it was created with (stamped `now` when the creator left it at 0)."""
    check_expected(expected_revision)
    stored = replace(record, revision=expected_revision + 1, updated_at=now)
    if isinstance(stored, Release) and not stored.created_at:
        stored = replace(stored, created_at=now)
    return stored


def version_conflict(stored: ModelVersion, new: ModelVersion) -> ConflictError:
    return ConflictError(
        f"model version {new.key} is already registered with a different record "
        f"(uri {stored.uri!r}, manifest {stored.manifest_sha256!r}, "
        f"serve_args {list(stored.serve_args)}); versions are immutable: add a new version")


def stale(kind: str, key: str, expected_revision: int, stored_revision: int) -> ConflictError:
    """The CAS lost: `stored_revision` 0 means the record does not exist."""
    if expected_revision == 0:
        return ConflictError(f"{kind} {key!r} already exists (revision {stored_revision}); "
                             "read it and update it with its revision")
    if stored_revision == 0:
        return ConflictError(f"{kind} {key!r} does not exist (expected revision "
                             f"{expected_revision}); create it with expected_revision=0")
    return ConflictError(f"{kind} {key!r} is at revision {stored_revision}, not "
                         f"{expected_revision}: it changed since it was read; read it again")


def release_in_progress(name: str, other_id: str, other_state: str) -> ConflictError:
    return ConflictError(f"model {name!r} already has a release in progress ({other_id}, "
                         f"{other_state}); wait for it to finish or roll it back first")


__all__ = ["Revisioned", "check_expected", "next_revision", "release_in_progress",
           "same_version", "stale", "stamp_version", "version_conflict"]
