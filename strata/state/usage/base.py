"""The usage store: what each tenant used, per model, and its budget window; shared by every
gateway that names the same store, so their counts add up and one budget holds across them.

Two kinds of record, both kept by wall-clock minute (`minute_of(now_s)`, the epoch minute):

    usage    (minute, tenant, model) -> Counts: requests, errors, rate-limited requests,
             prompt, cached and completion tokens; kept `retention_s`, summed by `totals`
    window   (tenant, minute) -> requests admitted and tokens charged in that minute: the
             fixed one-minute window a key's limits are checked against (`take`, `charge`)

Contract (tests/state/test_usage_store.py runs it on every backend):
- `add` and `charge` only ever add; two gateways adding at once lose nothing.
- `take` is atomic: it admits a request iff the window's requests are under `max_requests` and
  its tokens under `max_tokens` (None: no such limit), and counts it in the same step, so two
  gateways never both take the last request. Tokens are charged later (`charge`), when the
  answer's usage is known: a tenant passes its token limit by at most the tokens of the
  requests admitted before their charges landed.
- A window resets at the minute's end (`Window.reset_s`); a burst may use one window's budget
  at the end of a minute and the next one's at the start (fixed, not sliding, windows).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from strata.clock import Clock
from strata.errors import ConfigError

WINDOW_S = 60
COUNTERS = ("requests", "errors", "rate_limited", "prompt_tokens", "cached_tokens",
            "completion_tokens")


def minute_of(now_s: float) -> int:
    """The epoch minute `now_s` falls in."""
    return int(now_s // WINDOW_S)


@dataclass(frozen=True, slots=True)
class Counts:
    """What a tenant used of one model: requests (every one, refused ones too), errors (answers
    of status >= 400 and streams that ended in an error event), requests refused by its limits
    (`rate_limited`), and tokens as the answers' usage reported them."""

    requests: int = 0
    errors: int = 0
    rate_limited: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those served from the prefix cache
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, n) + getattr(other, n) for n in COUNTERS))

    def items(self) -> list[tuple[str, int]]:
        """(counter, value) of the non-zero counters."""
        return [(name, value) for name in COUNTERS if (value := getattr(self, name))]

    @classmethod
    def of(cls, values: Mapping[str, int]) -> Counts:
        return cls(**{name: int(values.get(name, 0)) for name in COUNTERS})

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total_tokens": self.total_tokens}


UsageKey = tuple[str, str]  # (tenant, model)


@dataclass(frozen=True, slots=True)
class Window:
    """A tenant's budget window as `take` left it: whether the request was admitted, the
    requests and tokens counted in the window (the admitted request included), and the seconds
    until it resets."""

    is_admitted: bool
    num_requests: int
    num_tokens: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class UsageStoreOptions:
    """What `create_usage_store` hands every backend's `from_url`: usage is kept `retention_s`
    (then `totals` no longer sees it); `clock` is wall time, shared by every gateway."""

    retention_s: float = 86400.0
    clock: Clock = time.time

    def __post_init__(self) -> None:
        if self.retention_s < WINDOW_S:
            raise ConfigError(f"usage retention_s must be at least {WINDOW_S}, got "
                              f"{self.retention_s}")


class UsageStore(Protocol):
    """Tenants' usage and budget windows (see the module docstring for the contract)."""

    async def add(self, tenant: str, model: str, counts: Counts) -> None:
        """Adds `counts` to the current minute's usage of (tenant, model)."""

    async def totals(self, since_s: float) -> dict[UsageKey, Counts]:
        """Usage summed over the minutes from the one `since_s` falls in to now."""

    async def take(self, tenant: str, *, max_requests: int | None,
                   max_tokens: int | None) -> Window:
        """Admits one request into the tenant's current window if it is under both limits."""

    async def charge(self, tenant: str, num_tokens: int) -> None:
        """Charges `num_tokens` to the tenant's current window."""

    async def close(self) -> None: ...


__all__ = ["COUNTERS", "WINDOW_S", "Counts", "UsageKey", "UsageStore", "UsageStoreOptions",
           "Window", "minute_of"]
