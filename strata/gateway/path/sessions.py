"""Session routing: where a request carrying a session id (`X-Session-Id` or the body's
`session_id`) goes, per `--session-routing`:

    none       the normal policy; the session id is forwarded untouched (the default)
    external   the same: any instance, which loads the history from the session store
    sticky     the session's pinned instance while it is a routable candidate and not over the
               bound; otherwise (new session, instance gone, ejected or over the bound) the
               bounded-load consistent hash places it and the pin is written by compare-and-set
               (a gateway that loses the race follows the winner's pin)
    hybrid     sticky, and a moved session's request carries `X-Strata-Session-Moved: 1` so the
               instance knows to rebuild it from the session store

The bound is ceil((1+epsilon) * mean) pinned sessions per candidate instance, counted over the
pin store that every gateway shares, so every gateway makes the same decision. Answers of sticky
and hybrid routing carry `X-Strata-Session-Routing: pinned|placed|moved` (or `unpinned` when the
pin store could not be reached: the request then goes where the plain consistent hash puts it).
Requests without a session id use the normal policy in every mode.

Two parts do this. Before routing, the `PlaceSession` step of the request path
(strata/gateway/path/forward.py) calls `SessionRouter.place`, which reads and writes the shared pin
store. Then the pipeline's policy, `PinnedSessionPolicy` around the configured one, sends a
request with a session id to the placement this gateway made last (or, on a retry after that
instance failed, to the bounded consistent hash over the candidates left).

Local reuse (`local_pin_max_age_s` > 0). A placement this gateway read from or wrote to the pin
store less than that age ago is answered again (as `pinned`) without reading the store, while
its instance is still a routable candidate under the bound; the age counts from the store
access, never from a reuse, so a pin another gateway wrote is followed within that age. Reuse
cannot corrupt a session: instances read the history from the session store and append under
its revision (strata/server/sessions.py), so a turn sent to the old instance during that window
answers from the whole history or gets a 409, and costs at most a KV cache miss.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from strata.clock import Clock
from strata.errors import PinStoreError
from strata.gateway.config import SessionRoutingConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies.base import RouteRequest, RoutingPolicy
from strata.gateway.routing.policies.consistent_hash import RingCache, is_over_bound, place
from strata.state.pins import PinStore

logger = logging.getLogger("strata.gateway.path.sessions")

ROUTING_HEADER = "x-strata-session-routing"
MOVED_HEADER = "x-strata-session-moved"
PINNED, PLACED, MOVED, UNPINNED = "pinned", "placed", "moved", "unpinned"
# served off its placement by a retry (its instance failed this once); the pin stays until the
# instance is ejected, leaves or is over the bound
REROUTED = "rerouted"
MAX_CAS_ROUNDS = 4


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a session goes and why (`outcome`: pinned, placed, moved or unpinned)."""

    instance_id: str | None
    outcome: str

    @property
    def is_moved(self) -> bool:
        return self.outcome == MOVED

    def outcome_served_by(self, instance_id: str | None) -> str:
        """The outcome, or `rerouted` when another instance than the placement served it."""
        if self.instance_id is not None and instance_id not in (None, self.instance_id):
            return REROUTED
        return self.outcome


class SessionRouter:
    """Pins sessions to instances (sticky and hybrid modes); one per gateway.

    `place` reads and writes the shared pin store; `prefer` answers synchronously (for the
    routing policy) from the placements this gateway made last (bounded, most recent kept)."""

    def __init__(self, config: SessionRoutingConfig, pins: PinStore, *,
                 clock: Clock = time.monotonic, max_local: int = 65536) -> None:
        self.config = config
        self.pins = pins
        self.clock = clock
        self.rings = RingCache(config.num_vnodes)
        self.max_local = max_local
        # session -> (instance, when that placement was read from or written to the store)
        self._local: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._counts: dict[str, int] = {}
        self._counts_at = -math.inf

    async def place(self, session_id: str, candidates: Sequence[InstanceView],
                    foreign: Collection[str] = ()) -> Placement:
        """The instance for `session_id` among `candidates` (non-empty), pinning it if needed.

        The mean load counts every pinned session except those on `foreign` instances (ones
        serving other models): sessions of instances that left are coming to the candidates."""
        ids = [view.instance_id for view in candidates]
        recent = await self._recent(session_id, ids, foreign)
        if recent is not None:
            return Placement(recent, PINNED)
        for _ in range(MAX_CAS_ROUNDS):
            pinned = await self.pins.get(session_id)
            counts, total = await self._loads(foreign)
            if pinned is not None and pinned in ids and not is_over_bound(
                    pinned, counts, ids, epsilon=self.config.epsilon, total=total):
                return self._remember(session_id, pinned, PINNED)
            target = self._target(session_id, pinned, counts, ids, total)
            if await self.pins.set_if(session_id, target, expected=pinned):
                self._count_move(pinned, target)
                return self._remember(session_id, target, PLACED if pinned is None else MOVED)
            winner = await self.pins.get(session_id)  # lost the race: follow the winner
            if winner in ids:
                self._counts_at = -math.inf
                return self._remember(session_id, winner, PLACED if pinned is None else MOVED)
        raise PinStoreError(f"session {session_id!r}: the pin kept changing under "
                            f"{MAX_CAS_ROUNDS} compare-and-set rounds")

    def prefer(self, session_id: str, candidates: Sequence[InstanceView]) -> InstanceView:
        """The candidate this gateway placed the session on; else (that one failed or was never
        placed) the bounded consistent hash over the candidates (non-empty)."""
        by_id = {view.instance_id: view for view in candidates}
        local = self._local.get(session_id)
        if local is not None and local[0] in by_id:
            return by_id[local[0]]
        ring = self.rings.ring_for(by_id)
        return by_id[place(ring, session_id, self._counts, epsilon=self.config.epsilon,
                           allowed=by_id)]

    async def forget(self, session_id: str) -> None:
        """Unpin a deleted session."""
        self._local.pop(session_id, None)
        await self.pins.delete(session_id)
        self._counts_at = -math.inf

    async def place_or_unpinned(self, session_id: str, candidates: Sequence[InstanceView],
                                foreign: Collection[str]) -> Placement:
        """`place`, or `unpinned` (no instance named) when the pin store fails."""
        try:
            return await self.place(session_id, candidates, foreign)
        except PinStoreError as exc:
            logger.warning("session %s routed without a pin: %s", session_id, exc)
            self._local.pop(session_id, None)
            return Placement(None, UNPINNED)

    def _target(self, session_id: str, pinned: str | None, counts: dict[str, int],
                ids: list[str], total: int) -> str:
        loads = dict(counts)
        if pinned is not None and loads.get(pinned, 0) > 0:
            loads[pinned] -= 1  # the session leaves its old instance
            total -= 1
        ring = self.rings.ring_for(ids)
        return place(ring, session_id, loads, epsilon=self.config.epsilon, allowed=ids,
                     total=total)

    async def _fresh_counts(self) -> dict[str, int]:
        if self.clock() - self._counts_at >= self.config.counts_max_age_s:
            self._counts = await self.pins.counts()
            self._counts_at = self.clock()
        return self._counts

    async def _loads(self, foreign: Collection[str]) -> tuple[dict[str, int], int]:
        """(pinned sessions per instance, their total less those on `foreign` instances)."""
        counts = await self._fresh_counts()
        return counts, sum(n for iid, n in counts.items() if iid not in foreign)

    def _count_move(self, old: str | None, new: str) -> None:
        if old is not None and self._counts.get(old, 0) > 0:
            self._counts[old] -= 1
        self._counts[new] = self._counts.get(new, 0) + 1

    async def _recent(self, session_id: str, ids: list[str],
                      foreign: Collection[str]) -> str | None:
        """This gateway's placement of `session_id` if read from the store less than
        `local_pin_max_age_s` ago and still valid among `ids` (see the module docstring)."""
        local = self._local.get(session_id)
        if local is None or self.clock() - local[1] >= self.config.local_pin_max_age_s:
            return None
        pinned = local[0]
        if pinned not in ids:
            return None
        counts, total = await self._loads(foreign)
        if is_over_bound(pinned, counts, ids, epsilon=self.config.epsilon, total=total):
            return None
        return pinned

    def _remember(self, session_id: str, instance_id: str, outcome: str) -> Placement:
        self._local[session_id] = (instance_id, self.clock())
        self._local.move_to_end(session_id)
        if len(self._local) > self.max_local:
            self._local.popitem(last=False)
        return Placement(instance_id, outcome)


class PinnedSessionPolicy:
    """The routing policy while sessions are pinned: a request with a session id goes where
    `sessions.prefer` says; every other request, and every hook, goes to `policy`."""

    def __init__(self, sessions: SessionRouter, policy: RoutingPolicy) -> None:
        self.sessions = sessions
        self.policy = policy
        self.name = policy.name

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        if request.session_id is None:
            return self.policy.choose(request, candidates)
        return self.sessions.prefer(request.session_id, candidates)

    def on_request_routed(self, request: RouteRequest, instance: InstanceView) -> None:
        self.policy.on_request_routed(request, instance)

    def on_request_finished(self, request: RouteRequest, instance: InstanceView,
                            *, is_success: bool) -> None:
        self.policy.on_request_finished(request, instance, is_success=is_success)


__all__ = ["MOVED", "MOVED_HEADER", "PINNED", "PLACED", "REROUTED", "ROUTING_HEADER", "UNPINNED",
           "PinnedSessionPolicy", "Placement", "SessionRouter"]
