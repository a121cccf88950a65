"""Version routing: which version of a model a request goes to, and how each version fares.

The version of a request, in this order:

    explicit   `X-Model-Version` or `model: "name@version"`: that version or a 404 when the model
               has no such version (registered, or served by some instance); never silently another
    session    a session stays on the version it started on while that version has a routable
               instance; once it retired, the session moves to the version new sessions get, the
               pin is rewritten, and the answer carries `X-Strata-Version-Moved: old->new` (the
               instance re-prefills the whole history from the session store on the new weights)
    canary     while a canary runs, `canary_weight` of new sessions (by a hash of the session id,
               so a session never flips) and of requests without a session go to the canary
    live       everything else goes to the model's `live` version

A model without a routing record (no registry, or an older cluster) is served by any version,
as before. The routing records of LoRA adapters (names with adapter versions registered) are
kept apart, in `adapters` and `adapter_versions`, for the adapter step (path/adapters.py).
The routing records are polled from the model registry (`refresh`, every
`routing_poll_s`), so every gateway sees a flip of the live pointer within that interval.

With a routing lease (`--release-consistency strict`, `lease_s`), a view that was not renewed
for `lease_s` (gateway/control/views.py renews it after each poll that read the registry and
published this gateway's view) is stale: every request whose version the routing view decides
(live, canary, a session's first turn or its move) is refused with a 503 and Retry-After until
a poll renews it. An explicit version and a session's existing pin still go through: the client
or the shared pin store named that version, not this view, and an answer always comes from the
version named (a pinned session stays on its version through a release by design).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, replace

from strata.clock import Clock
from strata.errors import PinStoreError
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.registry.models import ModelRegistry, ModelRouting
from strata.registry.releases.health import HealthWindow, window_of
from strata.state.pins import PinStore

logger = logging.getLogger("strata.gateway.path.versions")

MOVED_HEADER = "x-strata-version-moved"
EXPLICIT, SESSION, CANARY, LIVE, ANY = "explicit", "session", "canary", "live", "any"


@dataclass(frozen=True, slots=True)
class VersionChoice:
    """The version to filter on (None: any), why, and the session's old version if it moved;
    or a status code and reason when the request names a version that does not exist."""

    version: str | None
    source: str = ANY
    moved_from: str | None = None
    status_code: int = 200
    reason: str = ""
    is_pinned: bool = False  # a session's existing pin decided it, not the routing view
    retry_after_s: float | None = None

    @property
    def is_routed(self) -> bool:
        """Whether this gateway's routing view decided the version."""
        return self.source != EXPLICIT and not self.is_pinned


class VersionRouter:
    """Decides versions over the last routing records read from the model registry."""

    def __init__(self, models: ModelRegistry, instances: InstanceSet, pins: PinStore | None, *,
                 rng: random.Random | None = None, lease_s: float | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.models = models
        self.instances = instances
        self.pins = pins
        self.rng = rng or random.Random()
        self.lease_s = lease_s  # None: never stale (bounded)
        self.clock = clock
        self.renewed_at: float | None = None  # the start of the last poll that renewed the view
        self.routing: dict[str, ModelRouting] = {}
        self.versions: dict[str, set[str]] = {}
        self.adapters: dict[str, ModelRouting] = {}  # a registered adapter's routing, by name
        self.adapter_versions: dict[str, set[str]] = {}

    def renew(self, began_at: float) -> None:
        """A poll that began at `began_at` (this router's clock) read the registry and
        published its view: the view is fresh for `lease_s` from then."""
        if self.renewed_at is None or began_at > self.renewed_at:
            self.renewed_at = began_at

    @property
    def is_stale(self) -> bool:
        """With a lease: whether the view went unrenewed for longer than it."""
        if self.lease_s is None:
            return False
        return self.renewed_at is None or self.clock() - self.renewed_at > self.lease_s

    def served_revisions(self) -> tuple[tuple[str, int], ...]:
        """Per model and per adapter, the routing revision new traffic is served from: a
        record counts once its live version is routable here (until then `_reachable` keeps a
        model on `previous`, and AdapterRouter an adapter whose live version no instance lists
        while its previous one is listed)."""
        models = [(name, r.revision) for name, r in self.routing.items()
                  if r.live is None or self._reachable(r).live == r.live]
        adapters = [(name, r.revision) for name, r in self.adapters.items()
                     if r.live is None or self.lists(f"{name}@{r.live}")
                     or r.previous is None or not self.lists(f"{name}@{r.previous}")]
        return tuple(sorted(models + adapters))

    def lists(self, lora_name: str) -> bool:
        """Whether a routable instance lists the adapter `lora_name` (its heartbeat, as last
        read)."""
        return self.instances.lists(lora_name)

    async def refresh(self) -> None:
        """Read every routing record and version; on failure the last ones are kept."""
        routings = await self.models.list_routing()
        versions = await self.models.list_versions()
        known: dict[str, set[str]] = {}
        adapters: dict[str, set[str]] = {}
        for v in versions:
            (adapters if v.is_adapter else known).setdefault(v.name, set()).add(v.version)
        self.routing = {r.name: r for r in routings if r.name not in adapters}
        self.adapters = {r.name: r for r in routings if r.name in adapters}
        self.versions, self.adapter_versions = known, adapters

    def served(self, model: str, *, routable: bool) -> set[str]:
        """Versions of `model` that known (or only routable) instances serve."""
        return {v.version for v in self.instances.snapshot()
                if v.model == model and (v.is_routable or not routable)}

    async def choose(self, model: str | None, version: str | None, session_id: str | None,
                     *, avoid: str | None = None) -> VersionChoice:
        """The version for a request; `avoid`: a session's version that just failed to take it
        (every instance of it gone), so the session moves as if that version had retired. A
        stale view (with a lease) refuses a routed choice."""
        choice = await self._choose(model, version, session_id, avoid)
        if choice.is_routed and self.is_stale:
            return VersionChoice(
                None, choice.source, status_code=503, retry_after_s=1.0,
                reason=f"routing view stale: this gateway has not read the model registry for "
                       f"more than its routing lease ({self.lease_s:g} s), so it cannot tell "
                       "which version is live; retry, or name a version (X-Model-Version)")
        return choice

    async def _choose(self, model: str | None, version: str | None, session_id: str | None,
                      avoid: str | None) -> VersionChoice:
        if model is None and len(self.routing) == 1:
            model = next(iter(self.routing))
        if model is None:
            return VersionChoice(version, EXPLICIT if version else ANY)
        if version is not None:
            return self._explicit(model, version)
        routing = self.routing.get(model)
        if routing is None or routing.live is None:
            return VersionChoice(None, ANY)
        routing = self._reachable(routing)
        if session_id is not None and self.pins is not None:
            return await self._for_session(session_id, routing, avoid)
        is_canary = routing.canary is not None and self.rng.random() < routing.canary_weight
        return VersionChoice(routing.canary, CANARY) if is_canary else VersionChoice(
            routing.live, LIVE)

    def _reachable(self, routing: ModelRouting) -> ModelRouting:
        """`routing` as this gateway can serve it now. Routing records are polled faster than
        instances, so a flip (or a canary) can arrive before the new version's instances do:
        until one of them is routable here, live stays on `previous` and the canary gets no
        traffic, rather than answering 503 for a version that is up. With a lease (strict) live
        never falls back: `previous` is the version a flip retired (the routing poll re-reads
        the instances when a record changes, so the new ones are seen at once)."""
        def serves(version: str | None) -> bool:
            return version is not None and self.instances.serves(routing.name, version)

        live = routing.live
        if self.lease_s is None and not serves(live) and serves(routing.previous):
            live = routing.previous
        canary = routing.canary if serves(routing.canary) else None
        if live == routing.live and canary == routing.canary:
            return routing
        return replace(routing, live=live, canary=canary,
                       canary_weight=routing.canary_weight if canary else 0.0)

    def _explicit(self, model: str, version: str) -> VersionChoice:
        known = self.versions.get(model, set()) | self.served(model, routable=False)
        if version in known or not known:  # an unknown model: the pipeline answers 404
            return VersionChoice(version, EXPLICIT)
        listed = ", ".join(sorted(known)) or "none"
        return VersionChoice(None, EXPLICIT, status_code=404,
                             reason=f"Version `{version}` of model `{model}` does not exist; "
                                    f"versions: {listed}")

    async def _for_session(self, session_id: str, routing: ModelRouting,
                           avoid: str | None) -> VersionChoice:
        assert self.pins is not None
        routable = self.served(routing.name, routable=True) - {avoid}
        key = f"{routing.name}\x00{session_id}"
        try:
            pinned = await self.pins.get(key)
        except PinStoreError:
            logger.warning("version pin store unreachable; session %s is not pinned", session_id)
            return VersionChoice(_split(session_id, routing), SESSION)
        if pinned is not None and pinned in routable:
            return VersionChoice(pinned, SESSION, is_pinned=True)
        target = _split(session_id, routing)
        if target is None:
            return VersionChoice(None, ANY)
        if self.is_stale:  # a stale view must not write the pin it would then refuse
            return VersionChoice(target, SESSION)
        for _ in range(3):  # a racing gateway may pin first: follow its pin
            try:
                if await self.pins.set_if(key, target, expected=pinned):
                    break
                pinned = await self.pins.get(key)
            except PinStoreError:
                break
            if pinned is not None and pinned in routable:
                return VersionChoice(pinned, SESSION, is_pinned=True)
        moved = pinned if pinned is not None and pinned != target else None
        return VersionChoice(target, SESSION, moved_from=moved)


def _split(session_id: str, routing: ModelRouting) -> str | None:
    """The canary for `canary_weight` of sessions (a stable hash), else live."""
    if routing.canary is None or routing.canary_weight <= 0:
        return routing.live
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2**64
    return routing.canary if fraction < routing.canary_weight else routing.live


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float
    is_error: bool
    ttft_ms: float | None


class VersionStats:
    """Recent outcomes per name@version (a sliding window): what a canary is judged on, with
    the windows of every other gateway (gateway/releases.py publishes this one's)."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 10_000,
                 clock: Clock = time.monotonic) -> None:
        self.window_s = window_s
        self.max_samples = max_samples
        self.clock = clock
        self._outcomes: dict[tuple[str, str], deque[Outcome]] = {}

    def record(self, model: str, version: str, *, is_error: bool,
               ttft_ms: float | None = None) -> None:
        samples = self._outcomes.setdefault((model, version), deque(maxlen=self.max_samples))
        samples.append(Outcome(self.clock(), is_error, ttft_ms))

    def observe(self, view: InstanceView, is_error: bool, ttft_s: float | None) -> None:
        """One attempt's outcome on `view` (a proxy observer); views without a model are not
        counted."""
        if view.model:
            ttft_ms = ttft_s * 1000 if ttft_s is not None else None
            self.record(view.model, view.version, is_error=is_error, ttft_ms=ttft_ms)

    def recent(self, model: str, version: str) -> list[Outcome]:
        samples = self._outcomes.get((model, version))
        if not samples:
            return []
        cutoff = self.clock() - self.window_s
        while samples and samples[0].at < cutoff:
            samples.popleft()
        return list(samples)

    def window(self, gateway: str, model: str, version: str) -> HealthWindow:
        """This gateway's window of model@version in the registry's form (a TTFT histogram)."""
        return window_of(gateway, model, version,
                         ((o.is_error, o.ttft_ms) for o in self.recent(model, version)))

    def summary(self, model: str, version: str) -> tuple[int, int, float | None]:
        """(requests, errors, TTFT p99 in ms or None) over the window."""
        outcomes = self.recent(model, version)
        ttfts = sorted(o.ttft_ms for o in outcomes if o.ttft_ms is not None)
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
        return len(outcomes), sum(o.is_error for o in outcomes), p99


__all__ = ["MOVED_HEADER", "VersionChoice", "VersionRouter", "VersionStats"]
