"""The dashboard's data: one JSON snapshot of what this gateway knows (GET /dashboard/data).

    now          the gateway's wall clock, s
    gateway      port, policy, requests in flight and queued, instances known and routable
    control      which buttons can work here: `drain` always, `releases` with a model registry
    instances    per instance: model, version, role, pool, status (ready, starting, draining,
                 unhealthy, ejected, dead), load, heartbeat age, prefix-cache hit rate, node
    models       versions with their part (live, canary, previous), desired and running
                 replicas (dashboard_models.py)
    releases     the newest release of each model with the path of its state machine
    sessions     the routing mode; pinned sessions per instance while sessions are pinned
    caches       the response cache's hit rate and the instances' mean prefix-cache hit rate
    series       per-second columns of the last minutes (dashboard_series.py)
    autoscaler   null until an autoscaler reports; then its desired against actual replicas:
                 {"decided_at": s, "owner": str, "targets": [{"model", "version", "role",
                  "pool", "desired", "actual", "reason"}]}
    slow_requests  the slowest first bytes of the series' window, slowest first: [{"at",
                 "ttft_ms", "instance_id", "request_id", "trace_id"}] (trace_id null when
                 tracing is off or the request was not sampled); `trace_url`: the gateway's
                 --trace-url template ("{trace_id}" in it) that makes a trace id a link, or null
    tenants      null when the gateway keeps no usage; else what each tenant used over the
                 last `tenants_window_s`, summed over models and over every gateway sharing
                 the usage store, most tokens first: {"window_s": s, "rows": [{"tenant",
                 "requests", "errors", "rate_limited", "prompt_tokens", "cached_tokens",
                 "completion_tokens", "total_tokens"}]} (page.py shows a client key its own row
                 only)
    adapters     null unless the policy is adapter_aware; else per LoRA adapter the fleet
                 knows: [{"adapter", "replicas" (k), "share", "num_instances", "num_resident",
                 "num_loads", "num_evictions", "load_s"}] (routing/adapter_metrics.py), the
                 most resident first
    errors       what could not be read this time (the rest is still shown)

One snapshot serves every viewer for `max_age_s`; who may press the buttons is added per request
(strata/gateway/control/dashboard/page.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from strata.clock import Clock
from strata.gateway.control.dashboard.models import models_and_releases
from strata.gateway.control.dashboard.scrape import CounterReader
from strata.gateway.control.dashboard.series import LiveSeries
from strata.gateway.routing.instances import DEAD, DRAINING, STARTING, InstanceView
from strata.gateway.routing.sources import RegistrySource
from strata.gateway.wiring import Gateway
from strata.registry.instances.base import Registry
from strata.registry.instances.records import InstanceRecord
from strata.state.pins import PinStoreError
from strata.state.usage.base import Counts


class StatusReport(Protocol):
    """What a companion's status gives the dashboard (the autoscaler's:
    strata/autoscale/status.py): its JSON for the page."""

    def to_json(self) -> dict[str, Any]: ...


AutoscalerSource = Callable[[], Awaitable[StatusReport | None]]


def status_of(view: InstanceView) -> str:
    """One word for the instance's condition, the worst first."""
    if view.state == DEAD:
        return "dead"
    if not view.is_healthy:
        return "unhealthy"
    if view.is_ejected:
        return "ejected"
    if view.is_draining or view.state == DRAINING:
        return "draining"
    return "starting" if view.state == STARTING else "ready"


class DashboardData:
    """Builds the snapshot from the gateway's parts; cached for `max_age_s`."""

    def __init__(self, gateway: Gateway, series: LiveSeries, reader: CounterReader, *,
                 autoscaler: AutoscalerSource | None = None, window_s: int = 300,
                 tenants_window_s: float = 900.0, max_age_s: float = 0.5,
                 clock: Clock = time.time) -> None:
        self.gateway = gateway
        self.series = series
        self.reader = reader
        self.autoscaler = autoscaler
        self.window_s = window_s
        self.tenants_window_s = tenants_window_s
        self.max_age_s = max_age_s
        self.clock = clock
        self._built: tuple[float, dict[str, Any]] | None = None

    async def snapshot(self) -> dict[str, Any]:
        if self._built is not None and self.clock() - self._built[0] < self.max_age_s:
            return self._built[1]
        data = await self._build()
        self._built = (self.clock(), data)
        return data

    async def _build(self) -> dict[str, Any]:
        gateway, errors = self.gateway, list[str]()
        views = gateway.source.instances.snapshot()
        await self.reader.read(views)
        records = await self._records(errors)
        now = self.clock()
        rows = [self._instance(v, records.get(v.instance_id), now) for v in views]
        try:
            models, releases = await models_and_releases(gateway.models, views)
        except Exception as exc:  # the registry is down: show the rest
            models, releases = [], []
            errors.append(f"model registry: {type(exc).__name__}: {exc}")
        autoscaler = await self._autoscaler(errors)
        return {
            "now": now, "gateway": self._gateway(views), "instances": rows,
            "control": {"drain": True, "releases": gateway.releases is not None},
            "models": models, "releases": releases,
            "sessions": await self._sessions(errors), "caches": self._caches(rows),
            "series": self.series.window(self.window_s),
            "autoscaler": autoscaler.to_json() if autoscaler is not None else None,
            "slow_requests": [s.to_json() for s in self.series.slowest()],
            "trace_url": self.gateway.config.trace_url,
            "tenants": await self._tenants(now, errors),
            "adapters": self._adapters(),
            "errors": errors,
        }

    async def _tenants(self, now: float, errors: list[str]) -> dict[str, Any] | None:
        store = self.gateway.usage
        if store is None:
            return None
        try:
            totals = await store.totals(now - self.tenants_window_s)
        except Exception as exc:  # the store is down: show the rest
            errors.append(f"usage store: {type(exc).__name__}: {exc}")
            return {"window_s": self.tenants_window_s, "rows": []}
        by_tenant: dict[str, Counts] = {}
        for (tenant, _model), counts in totals.items():
            by_tenant[tenant] = by_tenant.get(tenant, Counts()) + counts
        ranked = sorted(by_tenant.items(),
                        key=lambda item: (-item[1].total_tokens, -item[1].requests, item[0]))
        rows = [{"tenant": tenant, **counts.as_dict()} for tenant, counts in ranked]
        return {"window_s": self.tenants_window_s, "rows": rows}

    def _adapters(self) -> list[dict[str, object]] | None:
        adapters = self.gateway.adapters
        if adapters is None:
            return None
        rows = sorted(adapters.rows(), key=lambda row: (-row.num_resident, -row.share, row.name))
        return [row.to_json() for row in rows]

    async def _autoscaler(self, errors: list[str]) -> StatusReport | None:
        if self.autoscaler is None:
            return None
        try:
            return await self.autoscaler()
        except Exception as exc:
            errors.append(f"autoscaler: {type(exc).__name__}: {exc}")
            return None

    async def _records(self, errors: list[str]) -> dict[str, InstanceRecord]:
        """The registry's records (heartbeat times) when instances come from a registry."""
        source = self.gateway.source
        registry = source.registry if isinstance(source, RegistrySource) else None
        if not isinstance(registry, Registry):
            return {}
        try:
            return {r.instance_id: r for r in await registry.list_instances()}
        except Exception as exc:
            errors.append(f"instance registry: {type(exc).__name__}: {exc}")
            return {}

    def _instance(self, view: InstanceView, record: InstanceRecord | None,
                  now: float) -> dict[str, Any]:
        age_s = max(0.0, now - record.last_heartbeat) if record is not None else None
        return {
            "instance_id": view.instance_id, "url": view.url, "model": view.model,
            "version": view.version, "role": view.role, "pool": view.pool, "state": view.state,
            "status": status_of(view), "routable": view.is_routable,
            "simulated": record.simulated if record is not None else None,
            "node": record.node if record is not None else None,
            "load": {"num_in_flight": view.num_in_flight,
                     "num_running": view.reported.num_running,
                     "num_waiting": view.reported.num_waiting,
                     "kv_usage": view.reported.kv_usage},
            "heartbeat_age_s": round(age_s, 2) if age_s is not None else None,
            "prefix_hit_rate": self.reader.prefix_hit_rate(view.instance_id),
        }

    def _gateway(self, views: list[InstanceView]) -> dict[str, Any]:
        gateway = self.gateway
        return {"port": gateway.config.port, "policy": gateway.config.policy,
                "num_in_flight": gateway.admission.num_in_flight,
                "num_queued": gateway.admission.num_queued, "num_instances": len(views),
                "num_routable": sum(v.is_routable for v in views),
                "has_model_registry": gateway.models is not None}

    async def _sessions(self, errors: list[str]) -> dict[str, Any]:
        sessions = self.gateway.sessions
        pinned: dict[str, int] | None = None
        if sessions is not None:
            try:
                pinned = await sessions.pins.counts()
            except PinStoreError as exc:
                errors.append(f"pin store: {exc}")
        return {"mode": self.gateway.config.sessions.mode, "pinned": pinned,
                "num_pinned": sum(pinned.values()) if pinned is not None else None}

    def _caches(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        cache = self.gateway.cache
        response = None
        if cache is not None:
            num_lookups = cache.hits + cache.misses
            response = {"hits": cache.hits, "misses": cache.misses,
                        "hit_rate": cache.hits / num_lookups if num_lookups else None}
        rates = [r["prefix_hit_rate"] for r in rows if r["prefix_hit_rate"] is not None]
        return {"response": response,
                "prefix_hit_rate_mean": sum(rates) / len(rates) if rates else None}


__all__ = ["AutoscalerSource", "DashboardData", "StatusReport",
           "status_of"]
