"""Make the fleet's secrets once, in a directory every container of it mounts (stdlib only).

    python keys.py /run/strata-keys [--strata-uid 10001 --redis-uid 999]

Each file is taken from the environment when set there, else made of 32 random bytes; a file
that already exists is kept (a restart keeps the fleet's keys). Files are written whole before
they appear (a temporary file, then a hard link that fails if another container won the race),
readable by their owner only (0600):

    api.keys        client keys, one per line        STRATA_API_KEYS (comma separated)
    admin.key       the operator's key                STRATA_ADMIN_KEYS
    internal.key    the fleet's own key               STRATA_INTERNAL_KEYS
    redis.password  Redis's password                  STRATA_REDIS_PASSWORD
    redis.conf      `requirepass` for redis-server    (from redis.password)

Run as root, it gives the files to the users that read them: redis.conf to Redis's, the rest to
Strata's (the image's user).

It prints which files it made or kept, never what is in them. deploy/compose.yaml runs it as a
one-shot service before anything else starts.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

FILES = {  # file -> the environment variable that supplies it
    "api.keys": "STRATA_API_KEYS",
    "admin.key": "STRATA_ADMIN_KEYS",
    "internal.key": "STRATA_INTERNAL_KEYS",
    "redis.password": "STRATA_REDIS_PASSWORD",
}


def supplied(name: str, env: dict[str, str]) -> list[str]:
    return [part.strip() for part in env.get(FILES[name], "").split(",") if part.strip()]


def write_once(path: Path, text: str) -> bool:
    """Writes `text` to `path` unless it exists; True when this call made it."""
    if path.exists():
        return False
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    try:
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        temporary.unlink()
    return True


def ensure(directory: Path, env: dict[str, str], *, strata_uid: int | None = None,
           redis_uid: int | None = None) -> list[str]:
    """Makes every missing file in `directory`; one line per file saying made or kept."""
    directory.mkdir(parents=True, exist_ok=True)
    said = []
    for name in FILES:
        values = supplied(name, env) or [secrets.token_urlsafe(32)]
        made = write_once(directory / name, "\n".join(values) + "\n")
        source = "kept" if not made else "from the environment" if supplied(name, env) \
            else "generated"
        said.append(f"{name}: {source}")
        give(directory / name, strata_uid)
    password = (directory / "redis.password").read_text(encoding="utf-8").strip()
    write_once(directory / "redis.conf", f"requirepass {password}\n")
    give(directory / "redis.conf", redis_uid)
    said.append("redis.conf: ready")
    return said


def give(path: Path, uid: int | None) -> None:
    if uid is not None and os.geteuid() == 0:
        os.chown(path, uid, uid)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--strata-uid", type=int, default=None,
                        help="owner of the keys when run as root (the image's user: 10001)")
    parser.add_argument("--redis-uid", type=int, default=None,
                        help="owner of redis.conf when run as root (the redis image's: 999)")
    args = parser.parse_args(argv)
    for line in ensure(args.directory, dict(os.environ), strata_uid=args.strata_uid,
                       redis_uid=args.redis_uid):
        print(f"keys: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
