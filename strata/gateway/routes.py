"""The gateway's route handlers; thin: parse what routing needs, then hand over.

What goes on to an instance never carries a header only the fleet may set from the client
(its key, the identity headers, a hand-off handle: strata/protocol/keys.py). With an internal
key the gateway sends that key instead of the client's, and the caller's identity (tenant,
priority ceiling) beside it, which the instance trusts from the internal key alone. A header
that chooses where a request goes (`X-Strata-Pool`) is the operator's: from a client key it is
a 403 (a client's priority class picks its pool).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from strata.errors import InvalidRequestError, StrataError
from strata.gateway.control.consistency import consistency
from strata.gateway.control.usage import usage
from strata.gateway.error_handlers import strata_error
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.deadline import until_cancelled
from strata.gateway.path.forward import Handler
from strata.gateway.path.requests import POOL_HEADER, route_request
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.pools import error_response
from strata.gateway.upstream.proxy import ProxyRequest
from strata.gateway.wiring import Gateway
from strata.protocol.auth import is_open
from strata.protocol.deadline import TIMEOUT_HEADER, request_timeout_s
from strata.protocol.keys import (
    FLEET_HEADERS,
    Keys,
    Kind,
    auth_header,
    caller_of,
    forwarded_identity,
)
from strata.protocol.priority import MAX_PRIORITY_STATE, PRIORITY_HEADER

OPERATOR_HEADERS = (POOL_HEADER,)  # headers that choose where a request goes


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


class Proxied:
    """A proxied route as a raw ASGI endpoint: the body read from `receive` as it came, the
    headers decoded once, no `Request` built (the route runs for every generation request; see
    bench/gateway_hotpath.py). `forward_of` picks the gateway's handler: the whole request path
    (forward.py) for /v1/completions, /v1/chat/completions and /v1/embeddings (`model` picks
    the instances; an embedding model's are `--task embed` ones), the proxy alone for
    /tokenize and /detokenize (cheap: no admission slot, version choice, response cache or
    pin-store placement)."""

    def __init__(self, forward_of: Callable[[Gateway], Handler], *, is_generation: bool) -> None:
        self.forward_of = forward_of
        self.is_generation = is_generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway: Gateway = scope["app"].state.gateway
        if self.is_generation:
            gateway.stats.request_entered()
        try:
            response = await _proxied(scope, receive, gateway, self.forward_of(gateway))
        except ClientDisconnect:
            return  # it left while sending its body: nobody to answer
        except StrataError as exc:  # as the exception middleware would answer it
            response = await strata_error(Request(scope), exc)
        await response(scope, receive, send)


class ProxiedFirst:
    """ASGI middleware, the innermost: a POST to a proxied route goes straight to its endpoint,
    past Starlette's exception middleware and router (the gateway's hot path). The router
    keeps those routes too, for what it answers about them (405 for another method, a path
    under a root path)."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Proxied]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_body(receive: Receive) -> bytes:
    """The request's body; a client that left while sending it raises `ClientDisconnect`."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _decoded(scope: Scope) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The request's headers decoded once: in order, and the first value of each name."""
    items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    first: dict[str, str] = {}
    for name, value in items:
        first.setdefault(name, value)
    return items, first


async def _proxied(scope: Scope, receive: Receive, gateway: Gateway,
                   forward: Handler) -> Response:
    received_at = gateway.proxy.clock()
    path: str = scope["path"]
    gateway.metrics.requests_by_endpoint.inc(path)
    body = await _read_body(receive)
    items, lookup = _decoded(scope)
    refused = _refused_routing(scope, lookup, gateway)
    if refused is not None:
        return refused
    try:
        route, data = route_request(body, lookup, max_priority=scope.get("state", {}).get(
            MAX_PRIORITY_STATE))
        timeout_s = request_timeout_s(lookup.get(TIMEOUT_HEADER), data.get("timeout"))
    except InvalidRequestError as exc:
        gateway.metrics.errors.labels("bad_request").inc()
        return error_response(400, str(exc))
    headers = [(k, v) for k, v in upstream_headers(scope, items, gateway)
               if k != PRIORITY_HEADER]
    headers.append((PRIORITY_HEADER, str(route.priority)))  # the instance gets it clamped
    deadline_s = None if timeout_s is None else received_at + timeout_s
    preq = ProxyRequest(scope["method"], path, body, headers, route, received_at, data,
                        deadline_s)
    return await until_cancelled(preq, forward, receive, gateway.metrics, gateway.proxy.clock)


def upstream_headers(scope: Scope, items: Iterable[tuple[str, str]],
                     gateway: Gateway) -> list[tuple[str, str]]:
    """The request's headers (`items`, decoded) as an instance gets them (see the module
    docstring)."""
    key = gateway.config.internal_key
    dropped = FLEET_HEADERS if key else FLEET_HEADERS - {"authorization"}
    headers = [(k, v) for k, v in items if k not in dropped]
    if key:
        headers.append(("authorization", f"Bearer {key}"))
    return headers + forwarded_identity(caller_of(scope))


def _refused_routing(scope: Scope, headers: Mapping[str, str],
                     gateway: Gateway) -> Response | None:
    """A 403 for a routing header from a caller who may not choose where requests go."""
    chosen = [name for name in OPERATOR_HEADERS if name in headers]
    if not chosen or _is_operator(scope, gateway):
        return None
    gateway.metrics.errors.labels("forbidden").inc()
    return error_response(403, f"{', '.join(chosen)} chooses where requests go: it takes the "
                               "admin or the internal key (a client's priority class picks its "
                               "pool)", kind="permission_error")


def _is_operator(scope: Scope, gateway: Gateway) -> bool:
    config = gateway.config
    keys = Keys(config.api_keys, config.admin_keys, config.internal_keys)
    return caller_of(scope).kind in (Kind.ADMIN, Kind.INTERNAL) or is_open("admin", keys)


async def session_call(request: Request) -> Response:
    """GET /v1/sessions[/{id}] and DELETE /v1/sessions/{id}: passed to any routable instance
    (every instance reads the same session store); a successful DELETE also unpins the session."""
    gateway = _gateway(request)
    # forwarded as received: re-quoted, so that an id with control or odd characters is
    # the same id on the instance (a decoded one made an invalid URL: a 500)
    path = quote(request.url.path, safe="/") + (f"?{request.url.query}" if request.url.query
                                                else "")
    preq = ProxyRequest(request.method, path, await request.body(),
                        upstream_headers(request.scope, request.headers.items(), gateway),
                        RouteRequest(), gateway.proxy.clock())
    response = await gateway.proxy.forward(preq)
    session_id = request.path_params.get("session_id")
    if (request.method == "DELETE" and response.status_code < 300 and session_id
            and gateway.sessions is not None):
        await gateway.sessions.forget(session_id)
    return response


async def models(request: Request) -> Response:
    """The models of routable instances, each once. A card says `deterministic` only when every
    routable instance of its model is (`strata serve --deterministic`): a request may land on
    any of them."""
    gateway = _gateway(request)
    deterministic: dict[str, bool] = {}
    for view in gateway.source.instances.snapshot():
        if view.is_routable and view.model:
            deterministic[view.model] = deterministic.get(view.model, True) and view.deterministic
    cards = [{"id": name, "object": "model", "owned_by": "strata",
              "deterministic": deterministic[name]} for name in sorted(deterministic)]
    return JSONResponse({"object": "list", "data": cards})


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    views = _gateway(request).source.instances.snapshot()
    num_routable = sum(v.is_routable for v in views)
    if num_routable == 0:
        return error_response(503, "no instance is ready", retry_after_s=1.0)
    return JSONResponse({"status": "ready", "num_routable": num_routable})


async def metrics(request: Request) -> Response:
    gateway = _gateway(request)

    def refresh(m: GatewayMetrics) -> None:
        m.in_flight.set(gateway.admission.num_in_flight)
        m.queued.set(gateway.admission.num_queued)
        m.routable.set(sum(v.is_routable for v in gateway.source.instances.snapshot()))
        if gateway.cache is not None:
            for event in ("hits", "misses", "stores", "skipped", "errors"):
                m.response_cache.labels(event).set(getattr(gateway.cache, event))

    return Response(gateway.metrics.render(refresh), media_type=CONTENT_TYPE_LATEST)


async def list_instances(request: Request) -> Response:
    views = _gateway(request).source.instances.snapshot()
    return JSONResponse({"instances": [v.describe() for v in views]})


async def drain_instance(request: Request) -> Response:
    """Stops routing to the instance at once, then asks it to drain (POST {url}/admin/drain)."""
    gateway = _gateway(request)
    instance_id = request.path_params["instance_id"]
    view = gateway.source.instances.get(instance_id)
    if view is None:
        return error_response(404, f"unknown instance {instance_id!r}; see GET /admin/instances")
    view.is_draining = True
    result: dict[str, Any] = {"instance_id": instance_id, "draining": True}
    try:
        answer = await gateway.control.post(f"{view.url}/admin/drain",
                                            headers=_admin_auth(gateway))
        result["instance_status"] = answer.status_code
    except Exception as exc:  # the instance may be gone; we stop routing there regardless
        result["instance_error"] = f"{type(exc).__name__}: {exc}"
    return JSONResponse(result, status_code=202)


def _admin_auth(gateway: Gateway) -> dict[str, str]:
    """What an instance's /admin/drain takes: the fleet's internal key, else the admin key."""
    config = gateway.config
    return auth_header(config.internal_key or (config.admin_keys or (None,))[0])


generate = Proxied(lambda gateway: gateway.forward, is_generation=True)
tokenizer_call = Proxied(lambda gateway: gateway.proxy.forward, is_generation=False)


PROXIED_ROUTES = {"/v1/completions": generate, "/v1/chat/completions": generate,
                  "/v1/embeddings": generate, "/tokenize": tokenizer_call,
                  "/detokenize": tokenizer_call}


def build_routes() -> list[Route]:
    return [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in PROXIED_ROUTES.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/sessions", session_call, methods=["GET"]),
        Route("/v1/sessions/{session_id}", session_call, methods=["GET", "DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/instances", list_instances, methods=["GET"]),
        Route("/admin/instances/{instance_id}/drain", drain_instance, methods=["POST"]),
        Route("/admin/consistency", consistency, methods=["GET"]),
        Route("/admin/usage", usage, methods=["GET"]),
    ]


__all__ = ["OPERATOR_HEADERS", "PROXIED_ROUTES", "Proxied", "ProxiedFirst", "build_routes",
           "upstream_headers"]
