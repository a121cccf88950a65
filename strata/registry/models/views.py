"""The gateways' routing views, published to the model registry: what each gateway routes from.

Every gateway with a model registry publishes one `RoutingView` after each poll that read the
registry (a change of what it serves at once, otherwise every quarter of its routing lease):
per model, the routing revision it serves new traffic from (the record's revision once the
live version is routable here, so a flip counts only when this gateway can act on it), when
it last read the registry, its lease and its level. A release driven at `--release-consistency
strict` reads the views after its flip (strata/registry/releases/flip_acks.py): it moves on
once every gateway's view carries the flip's revision, or has stopped changing for longer than
the lease (that gateway fenced itself: it refuses what its routing would decide).

    RoutingView      one gateway's view, as published (`seq` grows with every publish)
    ViewBoard        where views are published (every ModelRegistry is one)
    VIEW_RETENTION_S a view not republished for this long is of a gateway gone; dropped
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

VIEW_RETENTION_S = 60.0  # a live gateway republishes every lease/4; its fence ends far sooner
STRICT, BOUNDED = "strict", "bounded"
LEVELS = (STRICT, BOUNDED)


@dataclass(frozen=True, slots=True)
class RoutingView:
    """One gateway's routing view. `revisions`: (model, routing revision it serves from),
    sorted; `read_at`: its wall clock when that poll began; `lease_s`: how long after a poll
    whose view it could not publish it goes on routing (strict), `level`: strict or bounded;
    `published_at`: stamped by the board."""

    gateway: str
    revisions: tuple[tuple[str, int], ...] = ()
    read_at: float = 0.0
    lease_s: float = 0.0
    level: str = BOUNDED
    seq: int = 0
    published_at: float = 0.0

    def revision_of(self, name: str) -> int:
        """The routing revision of `name` this gateway serves from (0: none read yet)."""
        return dict(self.revisions).get(name, 0)

    @property
    def is_strict(self) -> bool:
        return self.level == STRICT

    def to_json(self) -> dict[str, Any]:
        return {"gateway": self.gateway, "revisions": [list(r) for r in self.revisions],
                "read_at": self.read_at, "lease_s": self.lease_s, "level": self.level,
                "seq": self.seq, "published_at": self.published_at}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoutingView:
        return cls(gateway=str(data["gateway"]),
                   revisions=tuple((str(n), int(r)) for n, r in data.get("revisions", ())),
                   read_at=float(data.get("read_at", 0.0)),
                   lease_s=float(data.get("lease_s", 0.0)),
                   level=str(data.get("level", BOUNDED)), seq=int(data.get("seq", 0)),
                   published_at=float(data.get("published_at", 0.0)))


@runtime_checkable
class ViewBoard(Protocol):
    """Where gateways publish their routing views (every ModelRegistry backend).

    Contract (tests/registry/test_routing_views.py, on every backend):
    - `put_view` stores `view` stamped `published_at = clock()`, replacing the gateway's
      previous view, and returns it as stored. Views not republished for VIEW_RETENTION_S are
      dropped (on a later write, or when listed).
    - `list_views` returns the views published in the last VIEW_RETENTION_S, sorted by gateway.
    """

    async def put_view(self, view: RoutingView) -> RoutingView: ...

    async def list_views(self) -> list[RoutingView]: ...


__all__ = ["BOUNDED", "LEVELS", "STRICT", "VIEW_RETENTION_S", "RoutingView", "ViewBoard"]
