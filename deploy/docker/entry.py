"""The image's entry point: `strata ARGS`, with the fleet's secrets in place first (stdlib only).

    python entry.py serve --api-key-file /run/strata-keys/api.keys ...
    python entry.py gateway --registry "redis://:{{redis.password}}@registry:6379/0" ...

Secrets live in STRATA_KEY_DIR (the image sets /run/strata-keys). When an argument names a
file there, or holds `{{NAME}}` (the first line of the file NAME there), the missing files are
made first (keys.py: from the environment, else random; existing ones kept), every `{{NAME}}`
is replaced by its value, and `strata` is executed with the result. Arguments that name nothing
there pass through untouched, and nothing is made (a chart that passes keys by environment).
So the image's default command starts as it is, keyed with keys made for it, and a Compose
fleet that mounts one key volume shares one set of keys, its Redis password included.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import keys  # noqa: E402 - beside this file in the image

PLACEHOLDER = re.compile(r"\{\{([A-Za-z0-9._-]+)\}\}")


def uses(arg: str, key_dir: Path) -> bool:
    return bool(PLACEHOLDER.search(arg)) or arg.startswith(f"{key_dir}/")


def resolved(argv: list[str], key_dir: Path, env: dict[str, str]) -> list[str]:
    """`argv` with the secrets it names made and filled in (see the module docstring)."""
    if not any(uses(arg, key_dir) for arg in argv):
        return argv
    keys.ensure(key_dir, env)

    def value(match: re.Match[str]) -> str:
        lines = (key_dir / match.group(1)).read_text(encoding="utf-8").splitlines()
        return lines[0].strip() if lines else ""

    return [PLACEHOLDER.sub(value, arg) for arg in argv]


def main(argv: list[str]) -> int:
    env = dict(os.environ)
    args = resolved(argv, Path(env.get("STRATA_KEY_DIR") or "/run/strata-keys"), env)
    os.execvp("strata", ["strata", *args])
    return 1  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
