"""An exclusive lock on a file, shared by the processes (and threads) of one machine: how the
users of one cache take turns filling it (flock: released when its holder dies)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_file` (created if missing) for the `with` block."""
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
