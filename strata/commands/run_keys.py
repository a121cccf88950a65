"""The keys a `strata up` run makes for itself: files in {run_dir}/keys, readable and writable by
their owner only (0600), written fresh at each start and removed at stop.

    internal.key   unless --internal-key-file or STRATA_INTERNAL_KEYS gives one: the fleet's
                   own key (strata/protocol/keys.py), passed to the gateway and every instance
    admin.key      when the cluster has client keys but no admin key (its /admin/* would be shut
                   to everyone): `strata models|release|rollback` on this machine read it
                   (strata/commands/control.py)

A key is 32 random bytes, URL-safe base64; it is never printed or logged.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

INTERNAL, ADMIN = "internal", "admin"


def key_path(run_dir: Path, kind: str) -> Path:
    return run_dir / "keys" / f"{kind}.key"


def write_key_file(path: Path) -> Path:
    """A new random key in `path`, created 0600 (never readable by others, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    return path


def local_admin_key(run_dir: Path) -> str | None:
    """The admin key a local `strata up` made, if it made one."""
    try:
        return key_path(run_dir, ADMIN).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The key files this run made (None: given, or not needed)."""

    internal: Path | None = None
    admin: Path | None = None

    @classmethod
    def make(cls, run_dir: Path, *, has_internal: bool, has_client: bool,
             has_admin: bool) -> RunKeys:
        internal = None if has_internal else write_key_file(key_path(run_dir, INTERNAL))
        needs_admin = has_client and not has_admin
        return cls(internal, write_key_file(key_path(run_dir, ADMIN)) if needs_admin else None)

    def flags(self) -> list[str]:
        """The key flags for the gateway and the instances."""
        out: list[str] = []
        for flag, path in (("--internal-key-file", self.internal),
                           ("--admin-key-file", self.admin)):
            if path is not None:
                out += [flag, str(path.resolve())]
        return out

    def remove(self) -> None:
        for path in (self.internal, self.admin):
            if path is not None:
                path.unlink(missing_ok=True)


NO_RUN_KEYS = RunKeys()  # a run that made none

__all__ = ["NO_RUN_KEYS", "RunKeys", "key_path", "local_admin_key", "write_key_file"]
