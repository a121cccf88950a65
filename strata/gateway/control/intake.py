"""What POST /admin/models may register. A version's URI and `serve_args` become the command line
of every instance started for it (strata/cluster/deployments.py), so this is where the gateway
decides what its fleet may run: a model only under the roots it was given (`--model-root`),
and only `strata serve` flags from one table, the ones that shape how a model runs. Nothing
that moves an instance (where it listens, registers or stores state), changes its keys, makes
it fetch from a new place (an S3 endpoint, a fault file) or replaces the model the URI names.
Each refusal is a ConfigError (400) that names the URI or the flag.

Roots (`--model-root`, repeatable; without one: DEFAULT_MODEL_ROOTS):

    alias:          a known model's name (smollm2): the instance's own table, never a path
    sim:            a simulated instance's profile (sim:NAME or sim:PATH)
    s3:             any s3:// URI;  s3://BUCKET/PREFIX/  only those under it
    /DIR            paths (and file:// URIs) under DIR, `..` resolved first; a relative path
                    is refused (it means nothing on another machine)
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from pathlib import PurePosixPath

from strata.errors import ConfigError

DEFAULT_MODEL_ROOTS = ("alias:", "sim:", "s3:")
SCHEME_ROOTS = ("alias:", "sim:", "s3:")
_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

# `strata serve` flags a version may carry: flag -> takes a value (tests/security holds this
# table to the real parser)
SERVE_ARGS: dict[str, bool] = {
    "--task": True, "--dtype": True, "--weights-dtype": True, "--device": True,
    "--max-model-len": True, "--kv-cache-gb": True, "--block-size": True,
    "--max-num-seqs": True, "--max-num-batched-tokens": True, "--no-prefix-cache": False,
    "--no-chunked-prefill": False, "--prefill-stretch": True, "--max-waiting": True,
    "--max-queue-wait-s": True, "--threads": True, "--generation-config": True,
    "--shutdown-timeout-s": True, "--keep-alive-s": True, "--log-level": True,
    "--sim-start-s": True, "--sim-kv-bandwidth-gbps": True, "--pd-lease-s": True,
    "--pd-shm-mb": True, "--kv-ttl-s": True, "--deterministic": False, "--no-deterministic": False,
    "--kv-min-fetch-tokens": True, "--kv-max-put-mb": True, "--tensor-parallel-size": True,
    "--pipeline-parallel-size": True, "--pipeline-layers": True,
}


def check_roots(roots: Sequence[str]) -> None:
    """Refuses a root that is none of the forms in the module docstring."""
    for root in roots:
        if root in SCHEME_ROOTS or _is_s3_prefix(root) or posixpath.isabs(root):
            continue
        raise ConfigError(f"--model-root {root!r}: expected alias:, sim:, s3:, "
                          "s3://BUCKET/PREFIX/ or an absolute directory")


def check_uri(uri: str, roots: Sequence[str]) -> None:
    """Refuses `uri` unless it is under one of `roots`."""
    if _is_allowed(uri, roots):
        return
    raise ConfigError(f"model URI {uri!r} is not under this gateway's model roots "
                      f"({', '.join(roots)}); start the gateway with --model-root for it")


def check_serve_args(args: Sequence[str]) -> None:
    """Refuses any argument that is not a flag of SERVE_ARGS (with its value when it takes
    one: `--flag VALUE` or `--flag=VALUE`)."""
    pending: str | None = None
    for arg in args:
        if pending is not None:
            pending = None
            continue
        name, has_value, _ = arg.partition("=")
        if name not in SERVE_ARGS:
            what = f"flag {name}" if arg.startswith("-") else f"argument {arg!r}"
            raise ConfigError(f"serve_args: {what} is not allowed for a model version "
                              f"(allowed: {', '.join(sorted(SERVE_ARGS))})")
        if has_value and not SERVE_ARGS[name]:
            raise ConfigError(f"serve_args: {name} takes no value")
        if SERVE_ARGS[name] and not has_value:
            pending = name
    if pending is not None:
        raise ConfigError(f"serve_args: {pending} needs a value")


def _is_allowed(uri: str, roots: Sequence[str]) -> bool:
    if uri.startswith("sim:"):
        return "sim:" in roots
    if uri.startswith("s3://"):
        return "s3:" in roots or any(_is_s3_prefix(r) and uri.startswith(r) for r in roots)
    if _ALIAS.fullmatch(uri):
        return "alias:" in roots
    path = uri.removeprefix("file://")
    if "://" in path or not posixpath.isabs(path):
        return False
    resolved = PurePosixPath(posixpath.normpath(path))
    return any(posixpath.isabs(r) and resolved.is_relative_to(posixpath.normpath(r))
               for r in roots)


def _is_s3_prefix(root: str) -> bool:
    return root.startswith("s3://") and root.endswith("/") and len(root) > len("s3://") + 1


__all__ = ["DEFAULT_MODEL_ROOTS", "SERVE_ARGS", "check_roots", "check_serve_args", "check_uri"]
