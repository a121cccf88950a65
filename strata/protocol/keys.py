"""The three kinds of key, the caller a key makes, and the identity the fleet forwards.

    client     the OpenAI API and the session routes. Each names a tenant (`tenant_of_key`: a
               sha256 prefix of the key, never the key) and may carry a priority ceiling
    admin      the operator's: /admin/* (models, releases, drains) and every client route
    internal   the fleet's own: gateway -> instance, instance -> instance. It opens the routes
               only the fleet calls, and carries a client's identity on the client routes

The gateway sends the internal key, never the client's, on everything it forwards; the client's
identity rides beside it in `X-Strata-Tenant` and `X-Strata-Max-Priority`
(`forwarded_identity`). An instance reads those two headers from an internal caller only: from
anyone else they are ignored, so no client can claim another's tenant or lift its ceiling.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from starlette.types import Scope

from strata.errors import ConfigError

TENANT_HEADER = "x-strata-tenant"
MAX_PRIORITY_HEADER = "x-strata-max-priority"
CALLER_STATE = "strata_caller"  # ASGI scope["state"] key: the Caller the middleware made
# headers only the fleet may set; a gateway drops a client's before forwarding
FLEET_HEADERS = frozenset({"authorization", TENANT_HEADER, MAX_PRIORITY_HEADER,
                           "x-strata-handoff"})


class Kind(enum.Enum):
    CLIENT = "client"
    ADMIN = "admin"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class Keys:
    """The keys one server takes, by kind (empty tuples: none of that kind). Every key is
    non-empty and no key is of two kinds."""

    client: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    internal: tuple[str, ...] = ()  # the first signs and is sent; the rest are still taken
    max_priority: Mapping[str, int] = field(default_factory=dict)  # client key -> ceiling

    def __post_init__(self) -> None:
        every = [*self.client, *self.admin, *self.internal]
        if any(not key for key in every):
            raise ConfigError("a key must not be an empty string")
        if len(set(every)) != len(every):
            raise ConfigError("a key is given twice or as two kinds (client, admin, internal); "
                              "each kind needs keys of its own")

    @property
    def is_empty(self) -> bool:
        return not (self.client or self.admin or self.internal)

    def of(self, kind: Kind) -> tuple[str, ...]:
        return {Kind.CLIENT: self.client, Kind.ADMIN: self.admin,
                Kind.INTERNAL: self.internal}[kind]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as the middleware found out: the kind of its key (None: no key, or
    one this server does not know), the tenant whose namespace it uses (None: the server's one
    namespace) and its priority ceiling."""

    kind: Kind | None = None
    tenant: str | None = None
    max_priority: int | None = None


ANONYMOUS_CALLER = Caller()


def tenant_of_key(key: str) -> str:
    """The tenant a client key names: a sha256 prefix of the key (the key itself is never kept
    or logged)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def bearer_key(authorization: str) -> str:
    """The key of an `Authorization: Bearer KEY` header value ("" for anything else)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def caller_of(scope: Scope) -> Caller:
    """The caller the middleware left in the request's state (anonymous without one)."""
    caller: Caller = scope.get("state", {}).get(CALLER_STATE, ANONYMOUS_CALLER)
    return caller


def forwarded_identity(caller: Caller) -> list[tuple[str, str]]:
    """The headers that carry `caller`'s identity beside the internal key."""
    out = [(TENANT_HEADER, caller.tenant)] if caller.tenant else []
    if caller.max_priority is not None:
        out.append((MAX_PRIORITY_HEADER, str(caller.max_priority)))
    return out


def internal_caller(headers: Iterable[tuple[bytes, bytes]]) -> Caller:
    """An internal caller, with the identity its headers forward (a ceiling that is not an
    integer is dropped: the fleet never sends one)."""
    tenant, ceiling = None, None
    for name, value in headers:
        if name == TENANT_HEADER.encode():
            tenant = value.decode("latin-1") or None
        elif name == MAX_PRIORITY_HEADER.encode():
            try:
                ceiling = int(value)
            except ValueError:
                ceiling = None
    return Caller(Kind.INTERNAL, tenant, ceiling)


def auth_header(key: str | None) -> dict[str, str]:
    """`Authorization: Bearer KEY`, or nothing without a key."""
    return {"Authorization": f"Bearer {key}"} if key else {}


__all__ = ["ANONYMOUS_CALLER", "CALLER_STATE", "FLEET_HEADERS", "MAX_PRIORITY_HEADER",
           "TENANT_HEADER", "Caller", "Keys", "Kind", "auth_header", "bearer_key", "caller_of",
           "forwarded_identity", "internal_caller", "tenant_of_key"]
