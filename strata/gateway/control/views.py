"""The routing poll: re-read the model registry, publish this gateway's routing view, renew it.

Every `routing_poll_s` the gateway reads the routing records (VersionRouter.refresh); then, when
what it serves changed or a quarter of its routing lease went by since it last published, it
publishes its view to the registry (registry/models/views.py): per model the revision it serves
new traffic from, when this poll began, its lease and its level. A publish that succeeded renews
the router's lease from the start of its poll; a read or a publish that failed renews nothing.

At `strict`, a poll that read a changed routing record re-reads the instances at once (the
router never sends a flipped model's traffic back to `previous` while the new version's
instances are not yet in its view).

So a view that changes proves a recent read, and one that stops changing is a gateway that
either lost the registry or died: at `--release-consistency strict`, within its lease it
refuses what its routing decides (VersionRouter.is_stale), which is what lets a strict release
count it as fenced (registry/releases/flip_acks.py). At `bounded` the view is published the
same way, for the record: nothing is refused.
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.gateway.path.versions import VersionRouter
from strata.gateway.routing.sources import InstanceSource
from strata.registry.models.views import STRICT, RoutingView, ViewBoard


class RoutingPoll:
    """One gateway's routing poll (`poll_once`, run every routing_poll_s)."""

    def __init__(self, router: VersionRouter, board: ViewBoard, *, gateway: str, level: str,
                 lease_s: float, source: InstanceSource | None = None,
                 clock: Clock = time.monotonic, wall: Clock = time.time) -> None:
        self.router, self.board, self.source = router, board, source
        self.gateway, self.level, self.lease_s = gateway, level, lease_s
        self.clock, self.wall = clock, wall
        self.published: RoutingView | None = None
        self._published_at: float | None = None  # this gateway's clock
        self._seq = 0

    async def poll_once(self) -> None:
        """Read, then publish when due and renew; raises when the registry fails."""
        began, began_wall = self.clock(), self.wall()
        before = {name: r.revision for name, r in self.router.routing.items()}
        await self.router.refresh()
        is_new = any(before.get(name) != r.revision for name, r in self.router.routing.items())
        if is_new and self.level == STRICT and self.source is not None:
            await self.source.refresh()  # a flip's new instances, before routing to them
        revisions = self.router.served_revisions()
        is_due = (self.published is None or revisions != self.published.revisions
                  or self._published_at is None
                  or began - self._published_at >= self.lease_s / 4)
        if not is_due:
            return
        self._seq += 1
        view = RoutingView(self.gateway, revisions, read_at=began_wall, lease_s=self.lease_s,
                           level=self.level, seq=self._seq)
        self.published = await self.board.put_view(view)
        self._published_at = began
        self.router.renew(began)


__all__ = ["RoutingPoll"]
