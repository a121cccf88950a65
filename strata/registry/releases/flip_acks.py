"""When a strict release may call its flip done: every gateway acknowledged it or fenced itself.

After the flip's compare-and-set (revision R of the model's routing), the release driver reads
the gateways' routing views (registry/models/views.py) every few hundredths of a second and
sorts each gateway into one of:

    acked     its view serves the model from revision >= R: its new traffic goes to the new
              version (the view counts a revision only once the live version is routable there)
    fenced    a strict gateway whose view has not changed for longer than its lease, timed on the
              driver's own clock from the first time the driver saw that view after the flip
    unfenced  the same silence from a bounded gateway: it does not fence itself, so nothing
              bounds what it routes; the flip goes on (strict holds only when every gateway is
              strict) and the count says so
    waiting   none of these yet

Why the silence proves the fence: a strict gateway renews its lease only with a poll whose
read of the registry and publish of its view both succeeded, counting the lease from before
that read; every publish changes its view (`seq`). A view the driver first saw at time O
(after the flip) was published before O, so the gateway's last renewal began before O (or
after the flip, and then it read revision R). Without a change it refuses routed requests from
that renewal + lease <= O + lease on: once the driver's clock passes O + lease, it is fenced.
Only clock rates are assumed to agree, not clock readings (the gateways' and the driver's
clocks are never compared).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.clock import Clock
from strata.registry.models.views import RoutingView


@dataclass(frozen=True, slots=True)
class FlipAcks:
    """Gateways by what they did about the flip (their ids, sorted)."""

    acked: tuple[str, ...] = ()
    fenced: tuple[str, ...] = ()
    unfenced: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()

    @property
    def is_done(self) -> bool:
        return not self.waiting


@dataclass(slots=True)
class FlipWatch:
    """Judges views of model `name` against the flip's routing revision; `clock`: the driver's.
    Feed it every list of views read after the flip, in order."""

    name: str
    revision: int
    clock: Clock
    _first_seen: dict[str, tuple[tuple[int, float], float]] = field(default_factory=dict)

    def judge(self, views: list[RoutingView]) -> FlipAcks:
        now = self.clock()
        acked: list[str] = []
        fenced: list[str] = []
        unfenced: list[str] = []
        waiting: list[str] = []
        for view in views:
            if view.revision_of(self.name) >= self.revision:
                acked.append(view.gateway)
            elif now - self._seen_since(view, now) > view.lease_s:
                (fenced if view.is_strict else unfenced).append(view.gateway)
            else:
                waiting.append(view.gateway)
        return FlipAcks(tuple(acked), tuple(fenced), tuple(unfenced), tuple(waiting))

    def _seen_since(self, view: RoutingView, now: float) -> float:
        """When the driver first saw `view` as it is now (a changed view starts again)."""
        signature = (view.seq, view.published_at)
        seen = self._first_seen.get(view.gateway)
        if seen is None or seen[0] != signature:
            self._first_seen[view.gateway] = (signature, now)
            return now
        return seen[1]


__all__ = ["FlipAcks", "FlipWatch"]
