"""The parts of one gateway, wired together (`build_gateway`); reachable from routes as
`app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from strata.gateway.admission import Admission
from strata.gateway.config import GatewayConfig
from strata.gateway.health import HealthChecker, OutlierDetector
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import RoutingPipeline
from strata.gateway.policies import create_policy
from strata.gateway.proxy import Proxy, ProxyRequest
from strata.gateway.retry import RetryBudget
from strata.gateway.sessions import SessionRouter
from strata.gateway.sources import InstanceSource
from strata.gateway.upstream import create_client
from strata.state.pins import PinStore, create_pin_store

logger = logging.getLogger("strata.gateway")


@dataclass(slots=True)
class Gateway:
    """Everything one gateway app holds."""

    config: GatewayConfig
    source: InstanceSource
    pipeline: RoutingPipeline
    proxy: Proxy
    admission: Admission
    detector: OutlierDetector
    health: HealthChecker
    control: httpx.AsyncClient  # health checks, refreshes, admin calls; short timeouts
    metrics: GatewayMetrics
    sessions: SessionRouter | None = None  # sticky and hybrid session routing
    owns_pins: bool = False  # the pin store was created here (closed with the gateway)

    async def forward(self, request: ProxyRequest) -> Response:
        """Route (placing the request's session first when sessions are pinned) and forward."""
        if self.sessions is not None:
            return await self.sessions.forward(self.proxy, request)
        return await self.proxy.forward(request)

    async def every(self, interval_s: float, step: Callable[[], Awaitable[None]]) -> None:
        """Runs `step` forever, `interval_s` apart; a failing step is logged, not fatal."""
        while True:
            try:
                await step()
            except Exception:
                logger.exception("background step failed")
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.proxy.client.aclose()
        with contextlib.suppress(Exception):
            await self.control.aclose()
        if self.sessions is not None and self.owns_pins:
            with contextlib.suppress(Exception):
                await self.sessions.pins.close()


def build_gateway(config: GatewayConfig, source: InstanceSource, *,
                  transport: httpx.AsyncBaseTransport | None = None,
                  control_client: httpx.AsyncClient | None = None,
                  clock: Callable[[], float] = time.monotonic,
                  rng: random.Random | None = None,
                  pin_store: PinStore | None = None) -> Gateway:
    """Wires the parts; `clock` drives ejection, the retry budget and the age of the session
    counts (tests inject one). `pin_store` overrides `config.sessions.store_url` (tests share
    one store between gateway objects)."""
    metrics = GatewayMetrics()
    instances = source.instances
    detector = OutlierDetector(instances, config.ejection, clock,
                               on_eject=lambda v: metrics.ejections.labels(v.instance_id).inc())
    pipeline = RoutingPipeline(instances, create_policy(config.policy, rng=rng))
    control = control_client or httpx.AsyncClient(
        transport=transport, timeout=httpx.Timeout(config.health_timeout_s))
    proxy = Proxy(pipeline, create_client(config, transport), detector,
                  RetryBudget(config.retry, clock), metrics, config.retry.max_retries)
    health = HealthChecker(instances, detector, control, config.health_timeout_s)
    sessions = _session_router(config, pin_store, clock)
    if sessions is not None:
        pipeline.prefer = sessions.prefer
    return Gateway(config, source, pipeline, proxy, Admission(config.admission), detector,
                   health, control, metrics, sessions, owns_pins=pin_store is None)


def _session_router(config: GatewayConfig, pin_store: PinStore | None,
                    clock: Callable[[], float]) -> SessionRouter | None:
    settings = config.sessions
    if not settings.is_pinning:
        return None
    pins = pin_store or create_pin_store(settings.store_url or "memory://",
                                         ttl_s=settings.pin_ttl_s)
    return SessionRouter(settings, pins, clock=clock)


__all__ = ["Gateway", "build_gateway"]
