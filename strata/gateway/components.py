"""The parts of one gateway, wired together (`build_gateway`); reachable from routes as
`app.state.gateway`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import httpx
from starlette.responses import Response

from strata.gateway.admission import Admission
from strata.gateway.config import GatewayConfig
from strata.gateway.health import HealthChecker, OutlierDetector
from strata.gateway.instances import InstanceView
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import RoutingPipeline
from strata.gateway.policies import create_policy
from strata.gateway.proxy import Proxy, ProxyRequest
from strata.gateway.releases import ReleaseService, build_release_service, controller_owner
from strata.gateway.response_cache import ResponseCacheLayer, cache_key
from strata.gateway.retry import RetryBudget
from strata.gateway.sessions import SessionRouter
from strata.gateway.sources import InstanceSource
from strata.gateway.upstream import RelayResponse, UpstreamPools, error_response
from strata.gateway.versions import (
    CANARY,
    LIVE,
    MOVED_HEADER,
    SESSION,
    VersionChoice,
    VersionRouter,
    VersionStats,
)
from strata.registry.base import Registry
from strata.registry.models import ModelRegistry
from strata.state.pins import PinStore, create_pin_store
from strata.state.response_cache import create_response_cache

logger = logging.getLogger("strata.gateway")
CACHE_HEADER = "x-strata-cache"


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
    versions: VersionRouter | None = None  # with a model registry: live, canary, pinned versions
    stats: VersionStats | None = None
    models: ModelRegistry | None = None
    releases: ReleaseService | None = None  # with a model registry and an instance registry
    cache: ResponseCacheLayer | None = None  # opt-in; deterministic answers keyed by version

    async def forward(self, request: ProxyRequest) -> Response:
        """Choose the version, route (placing the request's session first when sessions are
        pinned) and forward."""
        choice = await self._version(request)
        if choice is not None and choice.status_code != 200:
            self.metrics.errors.labels(f"version_{choice.status_code}").inc()
            return error_response(choice.status_code, choice.reason)
        if choice is not None:
            request = replace(request, route=replace(request.route, version=choice.version))
        key = self._cache_key(request, choice)
        if key is not None and self.cache is not None:
            cached = await self.cache.lookup(key)
            if cached is not None:
                return _cached_answer(cached, request, choice)
        response = await self._send(request)
        if _version_is_gone(choice, response):  # retired under a stale view: choose again
            assert choice is not None
            retry = await self._version_again(request, choice)
            if retry is not None and retry.version != choice.version:
                choice = retry
                response = await self._send(replace(request, route=replace(
                    request.route, version=choice.version)))
        if choice is not None and choice.moved_from is not None:
            response.headers[MOVED_HEADER] = f"{choice.moved_from}->{choice.version}"
        if key is not None and self.cache is not None and not isinstance(response, RelayResponse):
            await self.cache.store(key, response.status_code, bytes(response.body))
            response.headers[CACHE_HEADER] = "miss"
        return response

    def _cache_key(self, request: ProxyRequest, choice: VersionChoice | None) -> str | None:
        """The response-cache key, or None: no cache, no version known, a session's turn (its
        answer depends on the stored history), a stream, or a request that is not
        deterministic. Streams are turned away before the body is parsed again."""
        route = request.route
        if (self.cache is None or choice is None or choice.version is None or route.session_id
                or route.is_stream):
            return None
        routed = self.versions.routing if self.versions is not None else {}
        model = route.model or (next(iter(routed)) if len(routed) == 1 else None)
        try:
            body = json.loads(request.body)
        except ValueError:
            return None
        if model is None or not isinstance(body, dict):
            return None
        return cache_key(request.path, body, model=model, version=choice.version)

    async def _version_again(self, request: ProxyRequest,
                             failed: VersionChoice) -> VersionChoice | None:
        """After no instance of `failed.version` could take the request: a session moves off
        it; other requests re-read the routing pointers (a flip this gateway has not seen)."""
        assert self.versions is not None
        route = request.route
        if failed.source == SESSION:
            return await self.versions.choose(route.model, None, route.session_id,
                                              avoid=failed.version)
        try:
            await self.versions.refresh()
        except Exception:  # the registry is down: the answer stands
            return None
        return await self.versions.choose(route.model, None, route.session_id)

    async def _send(self, request: ProxyRequest) -> Response:
        if self.sessions is not None:
            return await self.sessions.forward(self.proxy, request)
        return await self.proxy.forward(request)

    async def _version(self, request: ProxyRequest) -> VersionChoice | None:
        if self.versions is None:
            return None
        route = request.route
        return await self.versions.choose(route.model, route.version, route.session_id)

    def observe(self, view: InstanceView, is_error: bool, ttft_s: float | None) -> None:
        """Per-version outcomes (what a canary is judged on)."""
        if self.stats is not None and view.model:
            ttft_ms = ttft_s * 1000 if ttft_s is not None else None
            self.stats.record(view.model, view.version, is_error=is_error, ttft_ms=ttft_ms)

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
            await self.proxy.upstreams.aclose()
        with contextlib.suppress(Exception):
            await self.control.aclose()
        if self.sessions is not None and self.owns_pins:
            with contextlib.suppress(Exception):
                await self.sessions.pins.close()
        if self.releases is not None:
            with contextlib.suppress(Exception):
                await self.releases.close()
        if self.cache is not None:
            with contextlib.suppress(Exception):
                await self.cache.close()
        if self.versions is not None and self.versions.pins is not None:
            with contextlib.suppress(Exception):
                await self.versions.pins.close()


def build_gateway(config: GatewayConfig, source: InstanceSource, *,
                  transport: httpx.AsyncBaseTransport | None = None,
                  control_client: httpx.AsyncClient | None = None,
                  clock: Callable[[], float] = time.monotonic,
                  rng: random.Random | None = None,
                  pin_store: PinStore | None = None,
                  models: ModelRegistry | None = None,
                  instance_registry: Registry | None = None) -> Gateway:
    """Wires the parts; `clock` drives ejection, the retry budget and the age of the session
    counts (tests inject one). `pin_store` overrides `config.sessions.store_url` (tests share
    one store between gateway objects). With `models` (the model registry), requests are routed
    by version (live, canary, session pins); with `instance_registry` too, releases are driven
    from here (the controller watches instances register there)."""
    metrics = GatewayMetrics()
    instances = source.instances
    detector = OutlierDetector(instances, config.ejection, clock,
                               on_eject=lambda v: metrics.ejections.labels(v.instance_id).inc())
    pipeline = RoutingPipeline(instances, create_policy(config.policy, config=config, rng=rng))
    control = control_client or httpx.AsyncClient(
        transport=transport, timeout=httpx.Timeout(config.health_timeout_s))
    proxy = Proxy(pipeline, UpstreamPools(config, transport), detector,
                  RetryBudget(config.retry, clock), metrics, config.retry.max_retries)
    health = HealthChecker(instances, detector, control, config.health_timeout_s)
    sessions = _session_router(config, pin_store, clock)
    if sessions is not None:
        pipeline.prefer = sessions.prefer
    gateway = Gateway(config, source, pipeline, proxy, Admission(config.admission), detector,
                      health, control, metrics, sessions, owns_pins=pin_store is None)
    if config.response_cache_url is not None:
        gateway.cache = ResponseCacheLayer(create_response_cache(
            config.response_cache_url, ttl_s=config.response_cache_ttl_s))
    if models is not None:
        gateway.models = models
        gateway.versions = VersionRouter(models, instances, _version_pins(config), rng=rng)
        gateway.stats = VersionStats(config.versions.stats_window_s)
        proxy.observers.append(gateway.observe)
        if instance_registry is not None:
            gateway.releases = build_release_service(
                models, instance_registry, gateway.stats, control,
                owner=controller_owner(config.port),
                warm_timeout_s=config.versions.warm_timeout_s,
                api_key=config.api_keys[0] if config.api_keys else None,
                config=config.versions.release)
    return gateway


def _version_is_gone(choice: VersionChoice | None, response: Response) -> bool:
    """No instance of a version the gateway chose (not one the client named) could take the
    request: the gateway's view of a retiring version can lag the registry by one refresh."""
    return (choice is not None and choice.source in (SESSION, LIVE, CANARY)
            and choice.moved_from is None and response.status_code in (502, 503)
            and not isinstance(response, RelayResponse))


def _cached_answer(body: bytes, request: ProxyRequest, choice: VersionChoice | None) -> Response:
    model = request.route.model or ""
    version = choice.version if choice is not None else ""
    return Response(body, 200, media_type="application/json",
                    headers={CACHE_HEADER: "hit", "x-model-version": f"{model}@{version}"})


def _version_pins(config: GatewayConfig) -> PinStore:
    """Session -> version pins, in the store every gateway of the cluster shares."""
    url = config.versions.pin_store_url or config.sessions.store_url
    if url is None and config.registry_url and not config.registry_url.startswith("memory"):
        url = config.registry_url
    return create_pin_store(url or "memory://", ttl_s=config.versions.pin_ttl_s,
                            namespace="versions")


def _session_router(config: GatewayConfig, pin_store: PinStore | None,
                    clock: Callable[[], float]) -> SessionRouter | None:
    settings = config.sessions
    if not settings.is_pinning:
        return None
    pins = pin_store or create_pin_store(settings.store_url or "memory://",
                                         ttl_s=settings.pin_ttl_s)
    return SessionRouter(settings, pins, clock=clock)


__all__ = ["Gateway", "build_gateway"]
