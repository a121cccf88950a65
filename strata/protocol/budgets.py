"""A client key's limits per minute, as the key file writes them beside the key.

    KEY[:MAX_PRIORITY] [rpm=N] [tpm=N]

`rpm`: requests a minute, `tpm`: tokens (prompt + completion) a minute; either or both, positive
integers. A key without them has no budget (the per-second `--rate-limit-per-s` still applies).
STRATA_API_KEYS takes the same form per comma-separated entry. A key given twice keeps the lower
of each limit. The gateway enforces them across every gateway sharing its usage store
(strata/gateway/tenants/budgets.py); a message about a bad value never shows the key.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from strata.errors import ConfigError
from strata.protocol.priority import split_key_spec

FORM = "KEY[:MAX_PRIORITY] [rpm=N] [tpm=N]"
FIELDS = {"rpm": "requests_per_min", "tpm": "tokens_per_min"}


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One key's limits a minute (None: no such limit)."""

    requests_per_min: int | None = None
    tokens_per_min: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("rpm", self.requests_per_min), ("tpm", self.tokens_per_min)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise ConfigError(f"an API key's {name} must be a positive integer, got "
                                  f"{value!r}; write {FORM}")

    def lower(self, other: KeyLimits) -> KeyLimits:
        """Each limit the lower of the two (a missing one is no limit)."""
        def low(a: int | None, b: int | None) -> int | None:
            return b if a is None else a if b is None else min(a, b)

        return KeyLimits(low(self.requests_per_min, other.requests_per_min),
                         low(self.tokens_per_min, other.tokens_per_min))


def split_limits(spec: str) -> tuple[str, KeyLimits | None]:
    """`KEY[:MAX_PRIORITY] rpm=N tpm=N` -> (`KEY[:MAX_PRIORITY]`, its limits); a spec without
    fields -> (spec, None). An unknown field or a value that is not a positive integer is a
    ConfigError naming the field, never the key."""
    head, *fields = spec.split()
    if not fields:
        return spec.strip(), None
    values: dict[str, int] = {}
    for text in fields:
        name, sep, value = text.partition("=")
        if not sep or name not in FIELDS:
            raise ConfigError(f"an API key's limit {text!r} is not rpm=N or tpm=N; write {FORM}")
        if FIELDS[name] in values:
            raise ConfigError(f"an API key's {name} is given twice; write {FORM}")
        try:
            values[FIELDS[name]] = int(value)
        except ValueError:
            raise ConfigError(f"an API key's {name} must be a positive integer, got "
                              f"{value!r}; write {FORM}") from None
    return head, KeyLimits(**values)


def key_limits(specs: Iterable[str]) -> tuple[list[str], dict[str, KeyLimits]]:
    """(the specs without their limits, {key: limits}); a key given twice keeps the lower."""
    bare: list[str] = []
    limits: dict[str, KeyLimits] = {}
    for spec in specs:
        head, found = split_limits(spec)
        bare.append(head)
        if found is not None:
            key, _ = split_key_spec(head)
            limits[key] = found.lower(limits[key]) if key in limits else found
    return bare, limits


__all__ = ["FORM", "KeyLimits", "key_limits", "split_limits"]
