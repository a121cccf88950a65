"""A client key's budget (rpm=, tpm= in the key file: strata/protocol/budgets.py), held across
every gateway that shares the usage store.

Window: fixed, one wall-clock minute (the epoch minute), in the store; every gateway counts
into the same one. A request is admitted while its tenant's window has requests left and its
charged tokens are under the limit, and is counted at once; its tokens are charged when its
answer's usage is known (a stream's at its end). So a tenant passes its token limit by at most
the tokens of the requests in flight when it reached it: with one request at a time, by one
request's tokens.

Why not the per-key token bucket of strata/protocol/auth.py (`--rate-limit-per-s`): that one is
per process, before the body is read (it cannot know tokens) and in front of every route; it
stays as the cheap per-second guard, this is the per-minute budget shared by the fleet.

Every admitted answer carries OpenAI's headers for each limit the key has:

    x-ratelimit-limit-requests      rpm              x-ratelimit-limit-tokens      tpm
    x-ratelimit-remaining-requests  rpm - admitted   x-ratelimit-remaining-tokens  tpm - charged
    x-ratelimit-reset-requests      until the minute ends (e.g. "17.3s", "420ms"), both
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from starlette.responses import Response

from strata.protocol.budgets import KeyLimits
from strata.protocol.errors import error_json, retry_after
from strata.protocol.keys import tenant_of_key
from strata.state.usage import UsageStore, Window


def limits_by_tenant(key_limits: Iterable[tuple[str, KeyLimits]]) -> dict[str, KeyLimits]:
    """The key file's limits by the tenant each key names (the key is not kept)."""
    return {tenant_of_key(key): limits for key, limits in key_limits}


class Budgets:
    """The tenants' limits and the store that holds their windows."""

    def __init__(self, store: UsageStore, limits: Mapping[str, KeyLimits]) -> None:
        self.store = store
        self.limits = dict(limits)

    async def take(self, tenant: str, limits: KeyLimits) -> Window:
        """Admits one request into the tenant's window, or says it is over (`is_admitted`)."""
        return await self.store.take(tenant, max_requests=limits.requests_per_min,
                                     max_tokens=limits.tokens_per_min)

    async def charge(self, tenant: str, num_tokens: int) -> None:
        if num_tokens > 0:
            await self.store.charge(tenant, num_tokens)


def rate_limit_headers(limits: KeyLimits, window: Window) -> dict[str, str]:
    """The `x-ratelimit-*` headers of each limit `limits` sets."""
    reset = _duration(window.reset_s)
    headers = {}
    for kind, limit, used in (("requests", limits.requests_per_min, window.num_requests),
                              ("tokens", limits.tokens_per_min, window.num_tokens)):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit - used))
            headers[f"x-ratelimit-reset-{kind}"] = reset
    return headers


def over_budget(limits: KeyLimits, window: Window) -> Response:
    """429 rate_limit_exceeded with Retry-After (the window's end) and the headers."""
    is_requests = (limits.requests_per_min is not None
                   and window.num_requests >= limits.requests_per_min)
    what = (f"{limits.requests_per_min} requests" if is_requests
            else f"{limits.tokens_per_min} tokens")
    message = (f"Rate limit reached for this API key: {what} per minute; retry after "
               f"{_duration(window.reset_s)}")
    body = error_json(429, message, kind="rate_limit_error", code="rate_limit_exceeded")
    headers = {**rate_limit_headers(limits, window), **retry_after(window.reset_s)}
    return Response(body, 429, headers=headers, media_type="application/json")


def _duration(seconds: float) -> str:
    """OpenAI's form of a reset: "420ms", "17.3s"."""
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    return f"{round(seconds, 1):g}s"


__all__ = ["Budgets", "limits_by_tenant", "over_budget", "rate_limit_headers"]
