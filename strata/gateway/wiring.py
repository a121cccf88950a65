"""The parts of one gateway, built and wired together (`build_gateway`); routes reach them as
`app.state.gateway`. The path a request takes through them is strata/gateway/path/forward.py.

Every part that holds connections or tasks registers its close on one `AsyncExitStack` as it is
built; `Gateway.close` unwinds it, so parts close in the reverse order of their construction
(releases first, the upstream pools and the control client last). A close that fails does not
stop the others.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from strata.clock import Clock
from strata.gateway.config import GatewayConfig
from strata.gateway.control.releases import ReleaseService, build_release_service, controller_owner
from strata.gateway.control.views import RoutingPoll
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.admission import Admission
from strata.gateway.path.classes import ClassFlow
from strata.gateway.path.forward import Handler, chain, path_steps
from strata.gateway.path.response_cache import ResponseCacheLayer
from strata.gateway.path.sessions import PinnedSessionPolicy, SessionRouter
from strata.gateway.path.versions import VersionRouter, VersionStats
from strata.gateway.routing.adapter_metrics import AdapterMetrics
from strata.gateway.routing.health import HealthChecker, OutlierDetector
from strata.gateway.routing.instances import InstanceSet
from strata.gateway.routing.pd import PDRouter
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies import (
    AdapterAwarePolicy,
    CacheAwarePolicy,
    RoutingPolicy,
    create_policy,
)
from strata.gateway.routing.prefix.feed import PrefixRouting
from strata.gateway.routing.prefix.index import PrefixIndex
from strata.gateway.routing.sources import InstanceSource
from strata.gateway.stats import GatewayStats
from strata.gateway.tenants.budgets import Budgets, limits_by_tenant
from strata.gateway.tenants.meter import MeterTenants
from strata.gateway.tenants.metrics import TenantMetrics
from strata.gateway.upstream.pools import UpstreamPools
from strata.gateway.upstream.proxy import Proxy
from strata.gateway.upstream.recovery import Recovery
from strata.gateway.upstream.resume import Resumer
from strata.gateway.upstream.retry import RetryBudget
from strata.gateway.upstream.stalls import StallWatch
from strata.registry.instances.base import Registry
from strata.registry.models import ModelRegistry
from strata.state.pins import PinStore, create_pin_store
from strata.state.response_cache import create_response_cache
from strata.state.usage import UsageStore, create_usage_store


@dataclass(slots=True)
class Gateway:
    """Everything one gateway app holds."""

    config: GatewayConfig
    source: InstanceSource
    proxy: Proxy  # routes and sends; `proxy.forward` alone serves /tokenize and /v1/sessions
    admission: Admission
    health: HealthChecker
    control: httpx.AsyncClient  # health checks, refreshes, admin calls; short timeouts
    metrics: GatewayMetrics
    forward: Handler  # the request path of /v1/completions and /v1/chat/completions
    exits: contextlib.AsyncExitStack
    sessions: SessionRouter | None = None  # sticky and hybrid session routing
    versions: VersionRouter | None = None  # with a model registry: live, canary, pinned versions
    models: ModelRegistry | None = None
    releases: ReleaseService | None = None  # with a model registry and an instance registry
    cache: ResponseCacheLayer | None = None  # opt-in; deterministic answers keyed by version
    prefix: PrefixRouting | None = None  # --policy cache_aware: feeds its index (in background)
    classes: ClassFlow | None = None  # priority classes: pools, flow control, shedding
    usage: UsageStore | None = None  # tenants' usage and budget windows (GET /admin/usage)
    adapters: AdapterMetrics | None = None  # --policy adapter_aware: the fleet's LoRA adapters
    routing_poll: RoutingPoll | None = None  # with a model registry: read, publish the view

    @property
    def stats(self) -> GatewayStats:
        """What this gateway measured of its traffic (the autoscaler reads it)."""
        return self.proxy.stats

    async def close(self) -> None:
        await self.exits.aclose()


def build_gateway(config: GatewayConfig, source: InstanceSource, *,
                  transport: httpx.AsyncBaseTransport | None = None,
                  control_client: httpx.AsyncClient | None = None,
                  clock: Clock = time.monotonic,
                  rng: random.Random | None = None,
                  pin_store: PinStore | None = None,
                  models: ModelRegistry | None = None,
                  instance_registry: Registry | None = None,
                  usage: UsageStore | None = None) -> Gateway:
    """Builds the parts; `clock` drives ejection, the retry budget and the age of the session
    counts (tests inject one). `pin_store` overrides `config.sessions.store_url` (tests share
    one store between gateway objects; the caller closes it). With `models` (the model
    registry), requests are routed by version (live, canary, session pins); with
    `instance_registry` too, releases are driven from here (the controller watches instances
    register there). `usage` overrides `config.usage_store_url` (the caller closes it).
    `control_client` is closed with the gateway."""
    policy = create_policy(config.policy, config=config, rng=rng, clock=clock)
    exits = contextlib.AsyncExitStack()
    metrics = GatewayMetrics()
    instances = source.instances
    sessions = _session_router(config, pin_store, clock, exits)
    prefix = _prefix_routing(config, policy, instances, clock, exits)
    adapters = AdapterMetrics(metrics.registry, policy, instances) \
        if isinstance(policy, AdapterAwarePolicy) else None
    if sessions is not None:
        policy = PinnedSessionPolicy(sessions, policy)
    control = control_client or httpx.AsyncClient(
        transport=transport, timeout=httpx.Timeout(config.health_timeout_s))
    _close_with(exits, control.aclose)
    proxy = _proxy(config, instances, policy, transport, clock, metrics, control, exits)
    health = HealthChecker(instances, proxy.detector, control, config.health_timeout_s)
    admission = Admission(config.admission)
    cache = _response_cache(config, exits)
    versions, releases, routing_poll = None, None, None
    if models is not None:
        owner = controller_owner(config.port)
        versions = _version_router(config, models, instances, rng, exits)
        routing_poll = _routing_poll(config, versions, models, source, owner)
        stats = VersionStats(config.versions.health_window_s)
        proxy.observers.append(stats.observe)
        if instance_registry is not None:
            releases = _release_service(config, models, instance_registry, stats, versions,
                                        control, exits, owner)
    classes = None
    if config.classes.is_on:
        classes = ClassFlow(config.classes, config.admission, instances, clock)
        _close_with(exits, classes.close)
    pd = None if config.pd.mode == "off" else PDRouter(
        config.pd, proxy.pipeline, proxy.upstreams, proxy.detector, metrics.registry,
        stats=proxy.stats, index=prefix.index if prefix is not None else None,
        seal_key=config.internal_key, clock=proxy.clock)
    usage = usage or _usage_store(config, exits)
    tenants = _meter(config, usage, metrics)
    steps = path_steps(admission=admission, metrics=metrics, proxy=proxy, versions=versions,
                       cache=cache, sessions=sessions, prefix=prefix, classes=classes, pd=pd,
                       tenants=tenants)
    forward = chain(steps, proxy.forward)
    return Gateway(config, source, proxy, admission, health, control, metrics, forward, exits,
                   sessions, versions, models, releases, cache, prefix, classes, usage,
                   adapters, routing_poll)


def _proxy(config: GatewayConfig, instances: InstanceSet, policy: RoutingPolicy,
           transport: httpx.AsyncBaseTransport | None, clock: Clock,
           metrics: GatewayMetrics, control: httpx.AsyncClient,
           exits: contextlib.AsyncExitStack) -> Proxy:
    detector = OutlierDetector(instances, config.ejection, clock,
                               on_eject=lambda v: metrics.ejections.labels(v.instance_id).inc())
    upstreams = UpstreamPools(config, transport)
    _close_with(exits, upstreams.aclose)
    stalls = StallWatch(config.resume, control, on_dead=lambda view, num_ended: (
        metrics.stalls.labels(view.instance_id).inc(num_ended)))
    _close_with(exits, stalls.aclose)
    return Proxy(RoutingPipeline(instances, policy), upstreams, detector,
                 RetryBudget(config.retry, clock), metrics, config.retry.max_retries,
                 Resumer(config.resume, metrics), stalls, stats=GatewayStats(clock),
                 recovery=Recovery(instances, config.admission.start_wait_s, clock=clock))


def _usage_store(config: GatewayConfig, exits: contextlib.AsyncExitStack) -> UsageStore:
    store = create_usage_store(config.usage_store_url, retention_s=config.tenants.retention_s)
    _close_with(exits, store.close)
    return store


def _meter(config: GatewayConfig, usage: UsageStore, metrics: GatewayMetrics) -> MeterTenants:
    """Usage per tenant and the keys' budgets, held in `usage` (strata/gateway/tenants/)."""
    settings = config.tenants
    tenants = TenantMetrics(metrics.registry, top_tenants=settings.top_tenants,
                            top_models=settings.top_models)
    budgets = Budgets(usage, limits_by_tenant(settings.key_limits))
    return MeterTenants(usage, budgets, tenants, metrics)


def _response_cache(config: GatewayConfig,
                    exits: contextlib.AsyncExitStack) -> ResponseCacheLayer | None:
    if config.response_cache_url is None:
        return None
    cache = ResponseCacheLayer(create_response_cache(config.response_cache_url,
                                                     ttl_s=config.response_cache_ttl_s),
                               is_per_tenant=bool(config.api_keys))
    _close_with(exits, cache.close)
    return cache


def _version_router(config: GatewayConfig, models: ModelRegistry, instances: InstanceSet,
                    rng: random.Random | None,
                    exits: contextlib.AsyncExitStack) -> VersionRouter:
    pins = _version_pins(config)
    _close_with(exits, pins.close)
    settings = config.versions
    return VersionRouter(models, instances, pins, rng=rng,
                         lease_s=settings.routing_lease_s if settings.is_strict else None)


def _routing_poll(config: GatewayConfig, versions: VersionRouter, models: ModelRegistry,
                  source: InstanceSource, owner: str) -> RoutingPoll:
    settings = config.versions
    return RoutingPoll(versions, models, gateway=owner, level=settings.release.consistency,
                       lease_s=settings.routing_lease_s, source=source)


def _release_service(config: GatewayConfig, models: ModelRegistry, instances: Registry,
                     stats: VersionStats, versions: VersionRouter, control: httpx.AsyncClient,
                     exits: contextlib.AsyncExitStack, owner: str) -> ReleaseService:
    releases = build_release_service(
        models, instances, stats, versions, control, owner=owner,
        warm_timeout_s=config.versions.warm_timeout_s,
        api_key=config.internal_key or config.client_key,
        publish_interval_s=config.versions.health_publish_s, config=config.versions.release,
        fleet_key=config.internal_key or (config.admin_keys or (None,))[0])
    _close_with(exits, releases.close)
    return releases


def _version_pins(config: GatewayConfig) -> PinStore:
    """Session -> version pins, in the store every gateway of the cluster shares."""
    return create_pin_store(config.version_pin_store_url, ttl_s=config.versions.pin_ttl_s,
                            namespace="versions")


def _session_router(config: GatewayConfig, pin_store: PinStore | None,
                    clock: Clock,
                    exits: contextlib.AsyncExitStack) -> SessionRouter | None:
    settings = config.sessions
    if not settings.is_pinning:
        return None
    pins = pin_store
    if pins is None:
        pins = create_pin_store(settings.store_url or "memory://", ttl_s=settings.pin_ttl_s)
        _close_with(exits, pins.close)
    return SessionRouter(settings, pins, clock=clock)


def _prefix_routing(config: GatewayConfig, policy: RoutingPolicy, instances: InstanceSet,
                    clock: Clock, exits: contextlib.AsyncExitStack) -> PrefixRouting | None:
    """The prefix index's feed: polls the instances' KV events over its own client. The
    cache-aware policy's index, or, with the P/D hand-off on, one that only the hand-off's
    decision reads (what each decode instance holds of a prompt)."""
    is_needed: Callable[[InstanceSet], bool] | None = None
    if isinstance(policy, CacheAwarePolicy):
        index = policy.index
    elif config.pd.mode != "off":
        index, is_needed = PrefixIndex(clock=clock), has_prefill_instance
    else:
        return None
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.health_timeout_s))
    prefix = PrefixRouting(index, instances, client, api_key=config.internal_key,
                           is_per_tenant=bool(config.api_keys), is_needed=is_needed)
    _close_with(exits, client.aclose)
    _close_with(exits, prefix.close)
    return prefix


def has_prefill_instance(instances: InstanceSet) -> bool:
    """Whether a prefill instance is registered (ready or not): the hand-off may happen."""
    return instances.has_role("prefill")


def _close_with(exits: contextlib.AsyncExitStack, close: Callable[[], Awaitable[object]]) -> None:
    """Registers `close` on the gateway's exit stack; its failure does not stop the others."""
    async def quietly() -> None:
        with contextlib.suppress(Exception):
            await close()

    exits.push_async_callback(quietly)


__all__ = ["Gateway", "build_gateway"]
