"""What the gateway reads from a request to route it (the body is forwarded untouched).

The body is parsed once, by the hardened reader (strata/protocol/json_body.py), when the request
enters (`route_request`); the parsed object rides on the `ProxyRequest` (`body_json`) for every
step that reads a field (the response cache's key, the prefix keys, the P/D decision, a resume).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strata.errors import InvalidRequestError
from strata.gateway.routing.policies.base import RouteRequest
from strata.protocol.json_body import parse_json_object
from strata.protocol.keys import TENANT_HEADER
from strata.protocol.priority import PRIORITY_HEADER, effective_priority

VERSION_HEADER = "x-model-version"
POOL_HEADER = "x-strata-pool"
SESSION_HEADER = "x-session-id"
DEFAULT_MAX_TOKENS = 16
BYTES_PER_TOKEN = 4  # a rough prompt-size estimate; only used to weigh load


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A client request to forward: the body bytes go to the instance untouched; `body_json` is
    the body as parsed when it entered (None: not a JSON object, or not parsed)."""

    method: str
    path: str
    body: bytes
    headers: list[tuple[str, str]]
    route: RouteRequest
    received_at: float
    body_json: dict[str, Any] | None = None
    deadline_s: float | None = None  # on the proxy's clock (strata/gateway/path/deadline.py)

    @property
    def tenant(self) -> str:
        """The tenant the gateway forwards for the caller's key ("": none, a keyless gateway)."""
        return next((value for name, value in self.headers if name == TENANT_HEADER), "")


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    is_bool_for_int = isinstance(value, bool) and kind is int
    if value is not None and (not isinstance(value, kind) or is_bool_for_int):
        raise InvalidRequestError(f"{name}: has the wrong type ({type(value).__name__})")
    return value


def _model_and_version(model: str | None,
                       header: str | None) -> tuple[str | None, str | None]:
    """`model: "name@version"` names a version as `X-Model-Version` does; both must agree."""
    if model is None or "@" not in model:
        return model, header or None
    name, _, version = model.partition("@")
    if not name or not version:
        raise InvalidRequestError(f"model: expected NAME or NAME@VERSION, got {model!r}")
    if header and header != version:
        raise InvalidRequestError(f"the X-Model-Version header asks for {header!r} but model "
                                f"asks for {model!r}; send one of them")
    return name, version


def route_request(body: bytes, headers: Mapping[str, str], *,
                  max_priority: int | None = None) -> tuple[RouteRequest, dict[str, Any]]:
    """RouteRequest from a JSON body (model, stream, max_tokens, session_id, priority) and the
    routing headers (the `X-Session-Id` header wins over the body's `session_id`;
    `model: "name@version"` and `X-Model-Version` select a version; `X-Priority` wins over the
    body's `priority`, and both are clamped to `max_priority`, the API key's ceiling); and the
    parsed body. A body that is not a JSON object, or a field of the wrong type, raises
    InvalidRequestError."""
    data = parse_json_object(body) if body else {}
    return _route(data, len(body), headers, max_priority), data


def _route(data: dict[str, Any], num_bytes: int, headers: Mapping[str, str],
           max_priority: int | None) -> RouteRequest:
    max_tokens = _field(data, "max_tokens", int) or DEFAULT_MAX_TOKENS
    model, version = _model_and_version(_field(data, "model", str), headers.get(VERSION_HEADER))
    return RouteRequest(
        model=model,
        version=version,
        pool=headers.get(POOL_HEADER),
        session_id=headers.get(SESSION_HEADER) or _field(data, "session_id", str),
        is_stream=bool(_field(data, "stream", bool)),
        num_tokens=num_bytes // BYTES_PER_TOKEN + max_tokens,
        priority=effective_priority(headers.get(PRIORITY_HEADER), data.get("priority"),
                                    max_priority),
    )


__all__ = ["POOL_HEADER", "SESSION_HEADER", "VERSION_HEADER", "ProxyRequest", "route_request"]
