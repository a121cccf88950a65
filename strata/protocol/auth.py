"""API keys for the gateway and the instance server: an ASGI middleware.

Two kinds of key. Client keys (`--api-key-file`, STRATA_API_KEYS) call the OpenAI API and the
session routes; each names a tenant (`tenant_of_key`: the sha256 of the key, never the key).
Admin keys (`--admin-key-file`, STRATA_ADMIN_KEYS) call everything under /admin/ (drain,
models, releases, rollback) and, being the operator's, every other route too. A server with
admin keys refuses a client key on /admin/ (403); one with client keys only lets them open
/admin/ too (the single-key setup of a loopback-only cluster). Without any key the server
is open, which `check_exposure` allows only on the loopback (or with --insecure).

`Authorization: Bearer KEY` is compared in constant time (`hmac.compare_digest` against every
key, no early exit). Each client key has its own token bucket when a rate limit is set. Answers,
with OpenAI error bodies:

    missing or unknown key        -> 401 invalid_api_key (WWW-Authenticate: Bearer)
    a client key on /admin/       -> 403 permission_error, when admin keys are set
    key over its rate             -> 429 rate_limit_exceeded (Retry-After)

Probes and scrapes (/health, /ready, /metrics, /load) need no key. A key may carry a priority
ceiling (strata/protocol/priority.py): the middleware leaves it in the request's state
(`scope["state"][MAX_PRIORITY_STATE]`) for the routes to clamp with.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from strata.clock import Clock
from strata.errors import ConfigError
from strata.protocol.errors import error_json
from strata.protocol.priority import MAX_PRIORITY_STATE

EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics", "/load"})
ADMIN_PREFIX = "/admin/"
Compare = Callable[[bytes, bytes], bool]


@dataclass(slots=True)
class TokenBucket:
    """`capacity` tokens, refilled at `rate_per_s`; one request takes one token."""

    rate_per_s: float
    capacity: float
    tokens: float
    updated_at: float

    def try_take(self, now: float) -> float:
        """0.0 when a token was taken, else the seconds until one is available."""
        elapsed = max(0.0, now - self.updated_at)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate_per_s)
        self.updated_at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


def match_key(presented: bytes, keys: Sequence[bytes], compare: Compare) -> int | None:
    """Index of the key equal to `presented`, comparing against every key (no early exit)."""
    found = None
    for index, key in enumerate(keys):
        if compare(presented, key):
            found = index
    return found


def tenant_of_key(key: str) -> str:
    """The tenant a client key names: a sha256 prefix of the key (the key itself is never kept
    or logged)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def bearer_key(authorization: str) -> str:
    """The key of an `Authorization: Bearer KEY` header value ("" for anything else)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(what: str, host: str, api_keys: Sequence[str], admin_keys: Sequence[str],
                   *, insecure: bool) -> None:
    """A server that listens beyond the loopback needs client keys and an admin key, unless
    told `--insecure`: otherwise anyone who reaches it could drain it or release a model."""
    if insecure or is_loopback(host) or (api_keys and admin_keys):
        return
    missing = " and ".join(name for name, keys in (("API keys", api_keys),
                                                    ("an admin key", admin_keys)) if not keys)
    raise ConfigError(
        f"{what} listens on {host} (beyond the loopback) without {missing}: anyone who reaches "
        "it could use it. Pass --api-key-file FILE and --admin-key-file FILE (or set "
        "STRATA_API_KEYS and STRATA_ADMIN_KEYS), or --insecure to serve it open on purpose")


class ApiKeyAuth:
    """ASGI middleware: `app.add_middleware(ApiKeyAuth, keys=[...], admin_keys=[...],
    rate_limit_per_s=5.0)`; either list may be empty, not both."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], *, admin_keys: Sequence[str] = (),
                 rate_limit_per_s: float | None = None,
                 burst: int | None = None, clock: Clock = time.monotonic,
                 compare: Compare = hmac.compare_digest,
                 exempt_paths: frozenset[str] = EXEMPT_PATHS,
                 max_priority: Mapping[str, int] | None = None) -> None:
        if not (keys or admin_keys) or any(not key for key in (*keys, *admin_keys)):
            raise ConfigError("API keys must be a non-empty list of non-empty strings; "
                              "leave auth off instead of passing no keys")
        if rate_limit_per_s is not None and rate_limit_per_s <= 0:
            raise ConfigError(f"rate_limit_per_s must be positive, got {rate_limit_per_s}")
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.admin_keys = [key.encode() for key in admin_keys]
        self.max_priority = [(max_priority or {}).get(key) for key in keys]
        self.rate_limit_per_s = rate_limit_per_s
        self.burst = burst if burst is not None else max(1, math.ceil(rate_limit_per_s or 1))
        self.clock = clock
        self.compare = compare
        self.exempt_paths = exempt_paths
        self._buckets: dict[int, TokenBucket] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        presented = _bearer(scope)
        if match_key(presented, self.admin_keys, self.compare) is not None:
            await self.app(scope, receive, send)  # the operator: no rate limit, every route
            return
        index = match_key(presented, self.keys, self.compare)
        if scope["path"].startswith(ADMIN_PREFIX) and self.admin_keys:
            await self._refuse_admin(send, is_client=index is not None)
            return
        if index is None and not self.keys:  # admin keys only: the OpenAI API is open
            await self.app(scope, receive, send)
            return
        if index is None:
            await _reject(send, 401, "invalid_request_error", "invalid_api_key",
                          "Incorrect or missing API key; send `Authorization: Bearer <key>`",
                          [(b"www-authenticate", b"Bearer")])
            return
        wait_s = self._take(index)
        if wait_s > 0:
            retry_after = str(max(1, math.ceil(wait_s))).encode()
            await _reject(send, 429, "rate_limit_error", "rate_limit_exceeded",
                          f"Rate limit of {self.rate_limit_per_s:g} requests/s exceeded for "
                          "this API key; retry later", [(b"retry-after", retry_after)])
            return
        if self.max_priority[index] is not None:
            scope.setdefault("state", {})[MAX_PRIORITY_STATE] = self.max_priority[index]
        await self.app(scope, receive, send)

    async def _refuse_admin(self, send: Send, *, is_client: bool) -> None:
        if is_client:
            await _reject(send, 403, "permission_error", "insufficient_permissions",
                          "This API key may not call the admin API; send an admin key "
                          "(--admin-key-file)", [])
            return
        await _reject(send, 401, "invalid_request_error", "invalid_api_key",
                      "Incorrect or missing admin key; send `Authorization: Bearer <admin key>`",
                      [(b"www-authenticate", b"Bearer")])

    def _take(self, index: int) -> float:
        if self.rate_limit_per_s is None:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = TokenBucket(self.rate_limit_per_s, float(self.burst), float(self.burst), now)
            self._buckets[index] = bucket
        return bucket.try_take(now)


def _bearer(scope: Scope) -> bytes:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


async def _reject(send: Send, status: int, kind: str, code: str, message: str,
                  extra_headers: list[tuple[bytes, bytes]]) -> None:
    body = error_json(status, message, kind=kind, code=code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


__all__ = ["ADMIN_PREFIX", "EXEMPT_PATHS", "ApiKeyAuth", "TokenBucket", "bearer_key",
           "check_exposure", "is_loopback", "match_key", "tenant_of_key"]
