"""What the CLI read from the environment, handed to every command."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from strata.commands.argtypes import positive_float
from strata.errors import ConfigError
from strata.protocol.budgets import KeyLimits, key_limits
from strata.protocol.priority import key_ceilings


@dataclass(frozen=True, slots=True)
class CliEnv:
    cache_dir: Path  # pulled models, dequantized weights
    run_dir: Path  # `strata up`: registry database, logs, pid files
    api_keys: tuple[str, ...] = ()  # STRATA_API_KEYS, comma separated (ceilings split off)
    key_max_priority: tuple[tuple[str, int], ...] = ()  # KEY:CEILING entries of STRATA_API_KEYS
    admin_keys: tuple[str, ...] = ()  # STRATA_ADMIN_KEYS, comma separated
    internal_keys: tuple[str, ...] = ()  # STRATA_INTERNAL_KEYS, comma separated
    key_limits: tuple[tuple[str, KeyLimits], ...] = ()  # rpm=/tpm= fields of STRATA_API_KEYS
    registry_url: str | None = None  # STRATA_REGISTRY
    log_format: str = "text"  # STRATA_LOG_FORMAT: a command's --log-format default


def add_auth_flags(p: argparse.ArgumentParser) -> None:
    """`--api-key-file`, `--admin-key-file`, `--internal-key-file`, `--insecure` and
    `--rate-limit-per-s`, the same on instances and gateways (strata/protocol/auth.py says what
    each key may call)."""
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file with one API key per line, KEY[:MAX_PRIORITY] [rpm=N] [tpm=N] "
                        "(MAX_PRIORITY: a class such as batch, or an integer: the key's "
                        "requests are clamped to it; rpm/tpm: requests and tokens a minute, "
                        "held by the gateway); STRATA_API_KEYS adds more")
    p.add_argument("--admin-key-file", type=Path, default=None,
                   help="file with the admin key(s) for /admin/* (drain, models, releases), "
                        "one per line (STRATA_ADMIN_KEYS adds more); a server with client keys "
                        "and no admin key keeps /admin/* shut")
    p.add_argument("--internal-key-file", type=Path, default=None,
                   help="file with the fleet's internal key(s), one per line, the first sent "
                        "(STRATA_INTERNAL_KEYS adds more): gateways and instances call each "
                        "other's fleet-only routes with it (hand-offs, resumes, feeds, drains) "
                        "and the gateway forwards a client's identity under it")
    p.add_argument("--insecure", action="store_true",
                   help="listen beyond the loopback without API keys and an admin key "
                        "(refused otherwise)")
    p.add_argument("--rate-limit-per-s", type=positive_float, default=None,
                   help="requests per second allowed per API key")


def read_api_keys(path: Path | None, env_keys: tuple[str, ...]) -> tuple[str, ...]:
    """Keys from the file (one per line; blank lines and # comments skipped) then the env;
    a `:MAX_PRIORITY` suffix and the `rpm=`/`tpm=` fields are not part of the key."""
    specs, _ = key_limits([*_key_file_lines(path, "--api-key-file"), *env_keys])
    keys, _ = key_ceilings(specs)
    return keys


def read_admin_keys(path: Path | None, env_keys: tuple[str, ...]) -> tuple[str, ...]:
    """Admin keys from the file (as read_api_keys, no priority suffix) then the env."""
    return tuple(dict.fromkeys([*_key_file_lines(path, "--admin-key-file"), *env_keys]))


def read_internal_keys(path: Path | None, env_keys: tuple[str, ...]) -> tuple[str, ...]:
    """Internal keys from the file (as read_admin_keys) then the env."""
    return tuple(dict.fromkeys([*_key_file_lines(path, "--internal-key-file"), *env_keys]))


def read_key_max_priority(path: Path | None,
                          env: CliEnv) -> tuple[tuple[str, int], ...]:
    """(key, priority ceiling) of every key given as KEY:MAX_PRIORITY, in the file or the env."""
    specs, _ = key_limits(_key_file_lines(path, "--api-key-file"))
    _, ceilings = key_ceilings(specs)
    for key, ceiling in env.key_max_priority:
        ceilings[key] = min(ceiling, ceilings.get(key, ceiling))
    return tuple(sorted(ceilings.items()))


def read_key_limits(path: Path | None,
                    env: CliEnv) -> tuple[tuple[str, KeyLimits], ...]:
    """(key, limits a minute) of every key given with rpm=/tpm= fields, in the file or the env
    (strata/protocol/budgets.py); a key in both keeps the lower of each limit."""
    _, limits = key_limits(_key_file_lines(path, "--api-key-file"))
    for key, found in env.key_limits:
        limits[key] = found.lower(limits[key]) if key in limits else found
    return tuple(sorted(limits.items()))


def _key_file_lines(path: Path | None, flag: str) -> list[str]:
    if path is None:
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read {flag} {path}: {exc}") from None
    stripped = (line.strip() for line in lines)
    return [line for line in stripped if line and not line.startswith("#")]
