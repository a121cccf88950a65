"""API keys for the gateway and the instance server: an ASGI middleware.

Three kinds of key (strata/protocol/keys.py): client, admin and internal. What a route takes is
its `Access`, written beside it in the OpenAPI table of its side (strata/protocol/openapi.py,
`AccessTable.of_operations`), so the documented answer and the middleware's are one:

    open       anyone                                  /health, /ready, /metrics, /load, the
                                                       dashboard's page and files
    client     a client, the admin or the internal key the OpenAI API, sessions, /dashboard/data
    admin      the admin key                           /admin/* of the gateway
    internal   the internal key                        /internal/*, /v1/strata/* of instances
    fleet      the internal or the admin key           an instance's /admin/drain

A path the table does not list takes what its prefix says (/admin/: admin, /internal/:
internal), else client, so a route added without a table row is never open.

A server without client keys serves the public (`check_exposure` allows that only on the
loopback or with --insecure): its client routes take anyone, and so does any other route whose
keys it lacks (a bare loopback `strata serve`). Once it has client keys, a route whose keys it
lacks is shut to everyone: no client key ever stands in for an admin or internal one.

`Authorization: Bearer KEY` is compared in constant time (`hmac.compare_digest` against every
key of every kind, no early exit). The middleware leaves the `Caller` in the request's state
(`caller_of`): its kind, tenant (client: the key's; internal: the one it forwards) and priority
ceiling (also under MAX_PRIORITY_STATE, for the routes that clamp). Each client key has its own
token bucket when a rate limit is set (per process, per second; the key file's per-minute
rpm=/tpm= budgets are held by the gateways together: strata/gateway/tenants/budgets.py). Answers,
with OpenAI error bodies:

    missing or unknown key              -> 401 invalid_api_key (WWW-Authenticate: Bearer)
    a known key the route does not take -> 403 permission_error insufficient_permissions
    a client key over its rate          -> 429 rate_limit_exceeded (Retry-After)
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from strata.clock import Clock
from strata.errors import ConfigError
from strata.protocol.errors import error_json
from strata.protocol.keys import (
    ANONYMOUS_CALLER,
    CALLER_STATE,
    Caller,
    Keys,
    Kind,
    bearer_key,
    internal_caller,
    tenant_of_key,
)
from strata.protocol.priority import MAX_PRIORITY_STATE

Access = Literal["open", "client", "admin", "internal", "fleet"]
TAKES: dict[Access, frozenset[Kind]] = {
    "open": frozenset(),
    "client": frozenset({Kind.CLIENT, Kind.ADMIN, Kind.INTERNAL}),
    "admin": frozenset({Kind.ADMIN}),
    "internal": frozenset({Kind.INTERNAL}),
    "fleet": frozenset({Kind.ADMIN, Kind.INTERNAL}),
}
EXEMPT_PATHS = frozenset({"/health", "/ready", "/metrics", "/load"})
ADMIN_PREFIX = "/admin/"
INTERNAL_PREFIX = "/internal/"
Compare = Callable[[bytes, bytes], bool]


def is_open(access: Access, keys: Keys) -> bool:
    """Whether `access` takes anyone on a server with `keys` (see the module docstring)."""
    if access == "open":
        return True
    if keys.client:
        return False
    return access == "client" or not any(keys.of(kind) for kind in TAKES[access])


class Documented(Protocol):
    """A documented route: an OpenAPI `Operation`."""

    @property
    def path(self) -> str: ...

    @property
    def access(self) -> Access: ...


class AccessTable:
    """Path -> Access: exact paths, then path templates (`/internal/kv/{handle}`), then the
    /admin/ and /internal/ prefixes, else client."""

    def __init__(self, routes: Iterable[tuple[str, Access]] = ()) -> None:
        self.exact: dict[str, Access] = {path: "open" for path in EXEMPT_PATHS}
        self.templates: list[tuple[re.Pattern[str], Access]] = []
        seen: dict[str, Access] = {}
        for path, access in routes:
            if seen.setdefault(path, access) != access:
                raise ConfigError(f"{path} is documented with two kinds of access: "
                                  f"{seen[path]} and {access}")
            if "{" in path:
                pattern = re.sub(r"\\{\w+\\}", "[^/]+", re.escape(path))
                self.templates.append((re.compile(pattern + "$"), access))
            else:
                self.exact[path] = access

    @classmethod
    def of_operations(cls, operations: Iterable[Documented]) -> AccessTable:
        """From OpenAPI `Operation`s (strata/protocol/openapi.py)."""
        return cls((op.path, op.access) for op in operations)

    def __call__(self, path: str) -> Access:
        found = self.exact.get(path)
        if found is not None:
            return found
        for pattern, access in self.templates:
            if pattern.match(path):
                return access
        if path.startswith(ADMIN_PREFIX):
            return "admin"
        return "internal" if path.startswith(INTERNAL_PREFIX) else "client"


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
    internal_keys=[...], access=AccessTable(...), rate_limit_per_s=5.0)`; the key lists may be
    empty, not all of them."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], *, admin_keys: Sequence[str] = (),
                 internal_keys: Sequence[str] = (), access: AccessTable | None = None,
                 rate_limit_per_s: float | None = None,
                 burst: int | None = None, clock: Clock = time.monotonic,
                 compare: Compare = hmac.compare_digest,
                 max_priority: Mapping[str, int] | None = None) -> None:
        self.keys = Keys(tuple(keys), tuple(admin_keys), tuple(internal_keys),
                         dict(max_priority or {}))
        if self.keys.is_empty:
            raise ConfigError("API keys must be a non-empty list of non-empty strings; "
                              "leave auth off instead of passing no keys")
        if rate_limit_per_s is not None and rate_limit_per_s <= 0:
            raise ConfigError(f"rate_limit_per_s must be positive, got {rate_limit_per_s}")
        self.app = app
        self.access = access or AccessTable()
        self._encoded = {kind: [key.encode() for key in self.keys.of(kind)] for kind in Kind}
        self.rate_limit_per_s = rate_limit_per_s
        self.burst = burst if burst is not None else max(1, math.ceil(rate_limit_per_s or 1))
        self.clock = clock
        self.compare = compare
        self._buckets: dict[int, TokenBucket] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = self.access(scope["path"])
        if access == "open":
            await self.app(scope, receive, send)
            return
        presented = _bearer(scope)
        caller, index = self._identify(presented, scope)
        if not is_open(access, self.keys) and caller.kind not in TAKES[access]:
            await self._refuse(send, access, caller, is_presented=bool(presented))
            return
        if caller.kind is Kind.CLIENT and index is not None:
            wait_s = self._take(index)
            if wait_s > 0:
                retry_after = str(max(1, math.ceil(wait_s))).encode()
                await _reject(send, 429, "rate_limit_error", "rate_limit_exceeded",
                              f"Rate limit of {self.rate_limit_per_s:g} requests/s exceeded "
                              "for this API key; retry later", [(b"retry-after", retry_after)])
                return
        state = scope.setdefault("state", {})
        state[CALLER_STATE] = caller
        if caller.max_priority is not None:
            state[MAX_PRIORITY_STATE] = caller.max_priority
        await self.app(scope, receive, send)

    def _identify(self, presented: bytes, scope: Scope) -> tuple[Caller, int | None]:
        """The caller `presented` makes, and its index among the client keys."""
        found = {kind: match_key(presented, self._encoded[kind], self.compare)
                 for kind in Kind}  # every kind is compared: no early exit
        if not presented:
            return ANONYMOUS_CALLER, None
        if found[Kind.INTERNAL] is not None:
            return internal_caller(scope.get("headers", ())), None
        key = presented.decode("latin-1")
        if found[Kind.ADMIN] is not None:
            return Caller(Kind.ADMIN, tenant_of_key(key) if self.keys.client else None), None
        index = found[Kind.CLIENT]
        if index is None:
            return ANONYMOUS_CALLER, None
        client_key = self.keys.client[index]
        return Caller(Kind.CLIENT, tenant_of_key(key),
                      self.keys.max_priority.get(client_key)), index

    async def _refuse(self, send: Send, access: Access, caller: Caller, *,
                      is_presented: bool) -> None:
        wanted = _WANTED[access]
        if caller.kind is None:
            what = "Incorrect" if is_presented else "Missing"
            await _reject(send, 401, "invalid_request_error", "invalid_api_key",
                          f"{what} key: this route takes {wanted}; send `Authorization: "
                          "Bearer <key>`", [(b"www-authenticate", b"Bearer")])
            return
        lacking = [kind.value for kind in TAKES[access] if not self.keys.of(kind)]
        why = (f"; this server has no {' or '.join(sorted(lacking))} key, so none opens it"
               if len(lacking) == len(TAKES[access]) else "")
        await _reject(send, 403, "permission_error", "insufficient_permissions",
                      f"A {caller.kind.value} key may not call this route: it takes "
                      f"{wanted}{why}", [])

    def _take(self, index: int) -> float:
        if self.rate_limit_per_s is None:
            return 0.0
        now = self.clock()
        bucket = self._buckets.get(index)
        if bucket is None:
            bucket = TokenBucket(self.rate_limit_per_s, float(self.burst), float(self.burst), now)
            self._buckets[index] = bucket
        return bucket.try_take(now)


_WANTED: dict[Access, str] = {
    "open": "anyone", "client": "an API key", "admin": "the admin key (--admin-key-file)",
    "internal": "the fleet's internal key (--internal-key-file)",
    "fleet": "the internal or the admin key",
}


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


__all__ = ["ADMIN_PREFIX", "EXEMPT_PATHS", "INTERNAL_PREFIX", "TAKES", "Access", "AccessTable",
           "ApiKeyAuth", "TokenBucket", "bearer_key", "check_exposure", "is_loopback", "is_open",
           "match_key", "tenant_of_key"]
