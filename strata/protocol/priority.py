"""The one priority API of gateway and instance: `X-Priority` or the body's `priority`.

A priority is a class name (`interactive`, `standard`, `batch`, `sheddable`) or an integer;
higher = more important, as in GIE, Dynamo and SGLang (strata.types.PriorityClass holds the
values). The header wins over the body; neither means `standard`. An API key may carry a
ceiling (`KEY:CLASS` or `KEY:INT` where keys are configured): its requests are clamped to it.
The gateway forwards the clamped integer in `X-Priority`; the instance clamps again with the
same keys, and its engine orders by it (strata/engine/priority.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from strata.errors import ConfigError, InvalidRequestError
from strata.types import PriorityClass

PRIORITY_HEADER = "x-priority"
MAX_PRIORITY_STATE = "strata_max_priority"  # ASGI scope["state"] key set by ApiKeyAuth
CLASS_NAMES = {klass.label: int(klass) for klass in sorted(PriorityClass, reverse=True)}
MAX_ABS_PRIORITY = 1000


def parse_priority(value: object) -> int | None:
    """A class name or an integer (or its decimal text) -> the integer; None -> None."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in CLASS_NAMES:
            return CLASS_NAMES[text]
        try:
            value = int(text)
        except ValueError:
            value = text
    if not isinstance(value, int) or isinstance(value, bool) \
            or abs(value) > MAX_ABS_PRIORITY:
        raise InvalidRequestError(
            f"priority: expected a class ({', '.join(CLASS_NAMES)}) or an integer in "
            f"[-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}] (higher = more important), got "
            f"{value!r}", param="priority")
    return value


def effective_priority(header: str | None, body: object, max_priority: int | None) -> int:
    """The header's priority, else the body's, else standard; clamped to `max_priority`."""
    requested = parse_priority(header) if header else parse_priority(body)
    priority = int(PriorityClass.STANDARD) if requested is None else requested
    return priority if max_priority is None else min(priority, max_priority)


def split_key_spec(spec: str) -> tuple[str, int | None]:
    """`KEY` -> (KEY, None); `KEY:CEILING` (a class name or integer) -> (KEY, ceiling). A
    suffix that is neither stays part of the key."""
    key, sep, ceiling = spec.rpartition(":")
    if not sep or not key:
        return spec, None
    try:
        return key, parse_priority(ceiling)
    except InvalidRequestError:
        return spec, None


def key_ceilings(specs: Iterable[str]) -> tuple[tuple[str, ...], dict[str, int]]:
    """(bare keys, {key: ceiling}) of key specs; a key given twice keeps its lowest ceiling."""
    keys: list[str] = []
    ceilings: dict[str, int] = {}
    for spec in specs:
        key, ceiling = split_key_spec(spec)
        if not key:
            raise ConfigError("an API key must not be empty")
        keys.append(key)
        if ceiling is not None:
            ceilings[key] = min(ceiling, ceilings.get(key, ceiling))
    return tuple(dict.fromkeys(keys)), ceilings


__all__ = ["CLASS_NAMES", "MAX_PRIORITY_STATE", "PRIORITY_HEADER", "effective_priority",
           "key_ceilings", "parse_priority", "split_key_spec"]
