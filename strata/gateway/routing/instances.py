"""What the gateway knows about each instance, and the set of them.

An `InstanceView` merges three sources: the instance's record (from the registry or learned from a
static URL), the gateway's own accounting (requests and tokens it has in flight there), and the
gateway's judgement of its health (consecutive failures, ejection). Records are replaced on every
refresh; the accounting and health fields survive refreshes.

The accounting has one door: `InstanceSet.begin` counts a request sent to an instance and
returns its `InFlight`, `InstanceSet.end` uncounts it once (a second end is a no-op). The proxy
(through the routing pipeline, which also tells the policy), the P/D router's prefill leg and the
capacity planner all count through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from strata.protocol.lora import AdapterResidency

READY, STARTING, DRAINING, DEAD = "ready", "starting", "draining", "dead"


@dataclass(frozen=True, slots=True)
class ReportedLoad:
    """Load as the instance last reported it (registry heartbeat or GET /load)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    # the LoRA adapters it knows by name, resident or loadable on demand (protocol/lora.py)
    adapters: Mapping[str, AdapterResidency] = field(default_factory=dict)


def adapters_by_name(adapters: Iterable[AdapterResidency]) -> dict[str, AdapterResidency]:
    return {adapter.name: adapter for adapter in adapters}


@dataclass(slots=True)
class InstanceView:
    """One instance as the gateway sees it. Fields below `reported` are the gateway's own."""

    instance_id: str
    url: str
    model: str
    version: str = "default"
    role: str = "mixed"
    pool: str = "default"
    state: str = READY
    reported: ReportedLoad = field(default_factory=ReportedLoad)
    # `strata serve --deterministic`: its tokens do not depend on batch, cache or resume
    deterministic: bool = False
    num_in_flight: int = 0
    num_in_flight_tokens: int = 0
    consecutive_failures: int = 0
    num_ejections: int = 0
    ejected_until: float = 0.0  # > 0 while ejected; cleared by a passing health check
    is_healthy: bool = True  # the last active health check passed
    healthy_at: float = 0.0  # when a health check last passed (the detector's clock)
    is_draining: bool = False  # drained through this gateway; stays so until the record goes

    @property
    def is_ejected(self) -> bool:
        return self.ejected_until > 0.0

    @property
    def is_routable(self) -> bool:
        return self.state == READY and not self.is_draining and not self.is_ejected

    @property
    def request_load(self) -> int:
        """Requests queued or running there. The gateway's own count is fresh; the reported one
        also covers other gateways. The max avoids counting our requests twice."""
        reported = self.reported.num_running + self.reported.num_waiting
        return max(self.num_in_flight, reported)

    def serves(self, model: str) -> bool:
        """Whether it answers `model`: its base model's name or an adapter it knows."""
        return model == self.model or model in self.reported.adapters

    def is_resident(self, adapter: str) -> bool:
        """Whether it reported `adapter`'s weights resident (a request runs without a load)."""
        residency = self.reported.adapters.get(adapter)
        return residency is not None and residency.is_resident

    @property
    def load_key(self) -> tuple[int, int, float]:
        """Ordering used by the load-aware policies (lower is less loaded)."""
        return (self.request_load, self.num_in_flight_tokens, self.reported.kv_usage)

    def describe(self) -> dict[str, Any]:
        """JSON for GET /admin/instances."""
        return {
            "instance_id": self.instance_id, "url": self.url, "model": self.model,
            "version": self.version, "role": self.role, "pool": self.pool, "state": self.state,
            "routable": self.is_routable, "healthy": self.is_healthy, "ejected": self.is_ejected,
            "ejected_until": self.ejected_until, "num_ejections": self.num_ejections,
            "consecutive_failures": self.consecutive_failures, "draining": self.is_draining,
            "num_in_flight": self.num_in_flight, "num_in_flight_tokens": self.num_in_flight_tokens,
            "reported": {"num_running": self.reported.num_running,
                         "num_waiting": self.reported.num_waiting,
                         "kv_usage": self.reported.kv_usage},
        }


@dataclass(slots=True)
class InFlight:
    """One request counted in flight on `view`, from `InstanceSet.begin` until `end`."""

    view: InstanceView
    num_tokens: int
    is_open: bool = True


class LoadLike(Protocol):
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def adapters(self) -> tuple[AdapterResidency, ...]: ...


class RecordLike(Protocol):
    """The fields of `strata.registry.InstanceRecord` the gateway reads."""

    @property
    def instance_id(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def role(self) -> str: ...  # a StrEnum: formats as its value
    @property
    def pool(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def load(self) -> LoadLike: ...
    @property
    def deterministic(self) -> bool: ...


def load_from_record(load: LoadLike) -> ReportedLoad:
    return ReportedLoad(load.num_running, load.num_waiting, load.kv_usage,
                        adapters_by_name(load.adapters))


class InstanceSet:
    """The instances known to this gateway, keyed by id (one per gateway; never global)."""

    def __init__(self, views: Iterable[InstanceView] = ()) -> None:
        self._views: dict[str, InstanceView] = {v.instance_id: v for v in views}

    def __len__(self) -> int:
        return len(self._views)

    def get(self, instance_id: str) -> InstanceView | None:
        return self._views.get(instance_id)

    def snapshot(self) -> list[InstanceView]:
        """All views, ordered by id (policies see a stable order)."""
        return [self._views[key] for key in sorted(self._views)]

    def serves(self, model: str, version: str | None) -> bool:
        """Whether some routable instance serves `model`@`version` (no sort, stops at one)."""
        return any(v.serves(model) and v.version == version and v.is_routable
                   for v in self._views.values())

    def has_role(self, role: str) -> bool:
        """Whether some instance of `role` is registered, ready or not (no sort, stops at one)."""
        return any(v.role == role for v in self._views.values())

    def lists(self, name: str) -> bool:
        """Whether some routable instance answers `name` (a model or an adapter it reported;
        no sort, stops at one)."""
        return any(v.serves(name) and v.is_routable for v in self._views.values())

    def begin(self, view: InstanceView, num_tokens: int) -> InFlight:
        """Count one request (of `num_tokens` estimated tokens) in flight on `view`."""
        view.num_in_flight += 1
        view.num_in_flight_tokens += num_tokens
        return InFlight(view, num_tokens)

    def end(self, in_flight: InFlight) -> bool:
        """Uncount `in_flight`; False when it had already ended (nothing changes)."""
        if not in_flight.is_open:
            return False
        in_flight.is_open = False
        in_flight.view.num_in_flight -= 1
        in_flight.view.num_in_flight_tokens -= in_flight.num_tokens
        return True

    def in_flight_by_pool(self) -> dict[str, int]:
        """Requests this gateway has in flight, by pool (pools with none are left out)."""
        counts: dict[str, int] = {}
        for view in self._views.values():
            if view.num_in_flight:
                counts[view.pool] = counts.get(view.pool, 0) + view.num_in_flight
        return counts

    def add(self, view: InstanceView) -> InstanceView:
        self._views[view.instance_id] = view
        return view

    def remove(self, instance_id: str) -> None:
        self._views.pop(instance_id, None)

    def apply_records(self, records: Sequence[RecordLike], *,
                      is_after_outage: bool = False) -> None:
        """Make the set mirror `records`: new ids added, known ones updated (keeping the
        gateway's accounting and health), missing ones removed.

        `is_after_outage` (the registry was unreachable a moment ago): every heartbeat is stale
        at once, so a record reported `dead` does not take a ready instance out of routing while
        that instance passes the gateway's own health checks; the gateway goes on routing on
        what it sees until the heartbeats resume."""
        seen = set()
        for record in records:
            seen.add(record.instance_id)
            self._apply(record, is_after_outage)
        for gone in set(self._views) - seen:
            del self._views[gone]

    def _apply(self, record: RecordLike, is_after_outage: bool) -> None:
        view = self._views.get(record.instance_id)
        is_alive = view is not None and view.state == READY and view.is_healthy
        if view is None:
            view = self.add(InstanceView(record.instance_id, record.url, record.model))
        state = str(record.state)
        view.url, view.model, view.version = record.url, record.model, str(record.version)
        view.role, view.pool = str(record.role), record.pool
        view.state = READY if state == DEAD and is_alive and is_after_outage else state
        view.reported = load_from_record(record.load)
        view.deterministic = record.deterministic


__all__ = ["DEAD", "DRAINING", "READY", "STARTING", "InstanceSet", "InstanceView", "InFlight",
           "RecordLike", "ReportedLoad"]
