"""The gateway's HTTP app: the OpenAI endpoints of an instance, proxied; its own probes, metrics
and admin endpoints.

    POST /v1/completions, /v1/chat/completions   admitted, routed, proxied (SSE relayed)
    POST /tokenize, /detokenize                   routed to any instance serving the model
    GET  /v1/models                               aggregated over routable instances
    GET  /health (the process), /ready (>= 1 routable instance), /metrics
    GET  /admin/instances                         the gateway's view of each instance
    GET  /admin/usage?since=...                   tenants' usage per model (control/usage.py)
    POST /admin/instances/{id}/drain              stop routing there, forward POST /admin/drain
    GET  /v1/sessions, GET/DELETE /v1/sessions/{id}   passed to any instance (the session store
                                                  is shared); a DELETE also unpins the session
    /admin/models, /admin/releases, ...           models, versions and releases (admin.py)
    GET  /dashboard, /dashboard/data              the live dashboard: the page is open, its data
                                                  takes a key (control/dashboard/page.py)

Only what routing needs is read from a body (model, stream, max_tokens); the bytes are forwarded
untouched. Each route takes the keys its OpenAPI row documents (strata/protocol/auth.py); what
the gateway forwards carries its internal key instead of the client's, the client's identity
beside it (routes.py). `X-Model-Version` (or `model: "name@version"`) names a version,
`X-Strata-Pool` a pool (from the internal or the admin key only: a client's class decides its
pool); with a model registry the gateway otherwise picks the version
(strata/gateway/path/versions.py). Every proxied answer carries `X-Strata-Instance: <instance id>`.
`--session-routing` decides where requests with a session id go (strata/gateway/path/sessions.py).
Every answer carries `X-Request-Id`: the client's when sane, else a new one, forwarded to the
instance too (strata/protocol/request_id.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import httpx
from starlette.applications import Starlette

from strata import tracing
from strata.clock import Clock
from strata.gateway.config import GatewayConfig
from strata.gateway.control.admin import admin_routes
from strata.gateway.control.dashboard.data import StatusReport
from strata.gateway.control.dashboard.page import dashboard_routes
from strata.gateway.error_handlers import EXCEPTION_HANDLERS
from strata.gateway.openapi_routes import gateway_access, openapi_route
from strata.gateway.routes import PROXIED_ROUTES, ProxiedFirst, build_routes
from strata.gateway.routing.sources import InstanceSource
from strata.gateway.wiring import Gateway, build_gateway
from strata.protocol.auth import ApiKeyAuth
from strata.protocol.request_id import RequestIdMiddleware
from strata.registry.instances.base import Registry
from strata.registry.models import ModelRegistry
from strata.state.pins import PinStore

logger = logging.getLogger("strata.gateway")
# the paths whose requests are traced: the client's work, not admin, health or metrics
TRACED_PREFIXES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                   "/detokenize")


class Companion(Protocol):
    """Runs beside the gateway with access to its parts (the autoscaler,
    strata/autoscale/gateway_link.py): attached once the gateway is built, run in its lifespan,
    asked for its status by the dashboard."""

    def attach(self, gateway: Gateway) -> None: ...

    async def run(self) -> None: ...

    async def status(self) -> StatusReport | None: ...


def create_gateway_app(config: GatewayConfig, source: InstanceSource, *,
                       transport: httpx.AsyncBaseTransport | None = None,
                       control_client: httpx.AsyncClient | None = None,
                       clock: Clock = time.monotonic,
                       rng: random.Random | None = None,
                       run_background: bool = True,
                       pin_store: PinStore | None = None,
                       models: ModelRegistry | None = None,
                       instance_registry: Registry | None = None,
                       autoscaler: Companion | None = None) -> Starlette:
    """The gateway ASGI app over `source`'s instances. With `run_background`, its lifespan
    refreshes the set every `poll_interval_s` and health-checks every
    `health_check_interval_s`; tests of single steps turn that off and call them directly.
    `pin_store` replaces the one `config.sessions.store_url` names (sticky/hybrid routing).
    With `models` (the model registry), requests are routed by version and the routing records
    are re-read every `config.versions.routing_poll_s`; with `instance_registry` too, the
    gateway drives releases (strata/gateway/control/releases.py). An `autoscaler` is attached to the
    built gateway, runs in the background and reports to the dashboard."""
    gateway = build_gateway(config, source, transport=transport, control_client=control_client,
                            clock=clock, rng=rng, pin_store=pin_store, models=models,
                            instance_registry=instance_registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = await _start_background(gateway) if run_background else []
        if run_background and autoscaler is not None:
            tasks.append(asyncio.create_task(autoscaler.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await gateway.close()

    if autoscaler is not None:
        autoscaler.attach(gateway)
    status = autoscaler.status if autoscaler is not None else None
    app = Starlette(routes=[*build_routes(), *admin_routes(),
                            *dashboard_routes(gateway, autoscaler=status), openapi_route()],
                    lifespan=lifespan, exception_handlers=dict(EXCEPTION_HANDLERS))
    app.state.gateway = gateway
    # innermost: the proxied routes' POSTs skip the exception middleware and the router
    app.add_middleware(ProxiedFirst, routes=PROXIED_ROUTES)
    if config.api_keys or config.admin_keys or config.internal_keys:
        app.add_middleware(ApiKeyAuth, keys=list(config.api_keys),
                           admin_keys=list(config.admin_keys),
                           internal_keys=list(config.internal_keys), access=gateway_access(),
                           rate_limit_per_s=config.rate_limit_per_s,
                           max_priority=dict(config.key_max_priority))
    if tracing.is_on():  # the request's span, its parent the client's `traceparent`
        app.add_middleware(tracing.TraceRequests, component="strata.gateway",
                           traced_prefixes=TRACED_PREFIXES)
    # outermost: the id (the client's, else a new one) is in the headers the proxy forwards
    app.add_middleware(RequestIdMiddleware)
    return app


async def _start_background(gateway: Gateway) -> list[asyncio.Task[None]]:
    config = gateway.config
    await gateway.source.refresh()
    tasks = [asyncio.create_task(every(config.poll_interval_s, gateway.source.refresh)),
             asyncio.create_task(every(config.health_check_interval_s,
                                       gateway.health.check_once)),
             asyncio.create_task(every(config.resume.stall_sweep_s, gateway.proxy.stalls.sweep))]
    if gateway.routing_poll is not None:  # re-reads the routing, publishes this gateway's view
        with contextlib.suppress(Exception):  # logged by `every` from then on
            await gateway.routing_poll.poll_once()
        tasks.append(asyncio.create_task(every(config.versions.routing_poll_s,
                                               gateway.routing_poll.poll_once)))
    if gateway.releases is not None:
        tasks.append(asyncio.create_task(every(gateway.releases.resume_interval_s,
                                               gateway.releases.resume_once)))
        tasks.append(asyncio.create_task(every(gateway.releases.publish_interval_s,
                                               gateway.releases.publish_health)))
        tasks.append(asyncio.create_task(every(gateway.releases.resume_interval_s,
                                               gateway.releases.sync_adapters)))
    if gateway.prefix is not None:
        tasks.append(asyncio.create_task(gateway.prefix.run()))
    return tasks


async def every(interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
    """Runs `step` forever, `interval_s` apart; a failing step is logged, not fatal. A
    cancellation that the step turned into another error (redis-py's reads under
    `asyncio.timeout` do, when the cancel meets their deadline) still ends the loop: otherwise
    the gateway's shutdown would wait on this task forever."""
    while True:
        try:
            await step()
        except Exception:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from None
            logger.exception("background step failed")
        await asyncio.sleep(interval_s)


__all__ = ["Gateway", "create_gateway_app"]
