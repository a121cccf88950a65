"""P's side of a hand-off: the blocks each handle holds, under a lease.

    granted --pull--> pulling --stream ends--> granted (pulled again by another D if asked)
       |                 |  stream broken (D died): the lease shrinks to the grace period
       |                 '--ack / expiry: released once the last pull has ended
       '--ack (DELETE) or expiry---------> released: the engine frees the blocks

A lease lasts `lease_s` (default 10 s) from its grant once a pull has begun; until then only
`unpulled_s` (default 2 s): the gateway sends the request on to D as soon as P answers, and a
live D starts its pull as the request enters its route, so a handle nobody pulled within that
grace belongs to a D that died (or never got it): its blocks are back in the free pool within
the grace (a D that comes later finds the handle gone and recomputes the prompt, P's first token
in hand). Blocks are released exactly once, and never while a pull is reading them (a held block
is never written: the engine thread reads it between two steps, whatever runs meanwhile). A
pull cut off by D's death shrinks the lease to `broken_grace_s`, long enough for the gateway to
send the request to another D that pulls again, short enough that a dead peer's blocks are back
in the free pool within that grace (after `expire` sees them).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from strata.clock import Clock
from strata.engine.outputs import HeldBlocks
from strata.types import RequestId


@dataclass(slots=True)
class Lease:
    handle: str
    request_id: RequestId
    held: HeldBlocks
    expires_at: float
    granted_at: float = 0.0
    has_been_pulled: bool = False  # a pull began: the full lease applies
    num_pulls: int = 0  # pulls reading the blocks now
    is_ended: bool = False  # acknowledged or expired: no new pull; released when idle
    is_released: bool = False
    why: str = ""  # acked, expired, unpulled (no D came), broken (a pull was cut off), shutdown,
    # cancelled (the client left, or the deadline passed, before the handle was answered)


class LeaseTable:
    """The handles this instance answered and the blocks they hold (module docstring).
    `release` hands a request's held blocks back to the engine (`AsyncEngine.release_held`)."""

    def __init__(self, release: Callable[[RequestId], None], *, lease_s: float = 10.0,
                 broken_grace_s: float = 2.0, unpulled_s: float = 2.0,
                 clock: Clock = time.monotonic,
                 on_release: Callable[[Lease], None] | None = None) -> None:
        self.release = release
        self.lease_s = lease_s
        self.broken_grace_s = broken_grace_s
        self.unpulled_s = unpulled_s
        self.clock = clock
        self.on_release = on_release  # metrics: `lease.why` says why
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(lease.held) for lease in self._leases.values())

    def grant(self, request_id: RequestId, held: HeldBlocks) -> Lease:
        now = self.clock()
        lease = Lease(uuid.uuid4().hex, request_id, held,
                      now + min(self.lease_s, self.unpulled_s), granted_at=now)
        self._leases[lease.handle] = lease
        return lease

    def begin_pull(self, handle: str) -> Lease | None:
        """The lease to stream from, or None: unknown, acknowledged or expired."""
        lease = self._leases.get(handle)
        if lease is None or lease.is_ended or self.clock() >= lease.expires_at:
            return None
        if not lease.has_been_pulled:
            lease.has_been_pulled = True
            lease.expires_at = lease.granted_at + self.lease_s
        lease.num_pulls += 1
        return lease

    def end_pull(self, lease: Lease, *, is_complete: bool) -> None:
        lease.num_pulls -= 1
        if not is_complete:
            lease.expires_at = min(lease.expires_at, self.clock() + self.broken_grace_s)
            lease.why = lease.why or "broken"
        self._release_if_idle(lease)

    def ack(self, handle: str, why: str = "acked") -> bool:
        """D has what it needs (or the request was cancelled: `why`): release (once no pull
        reads the blocks). False if unknown."""
        lease = self._leases.get(handle)
        if lease is None:
            return False
        lease.is_ended, lease.why = True, why
        self._release_if_idle(lease)
        return True

    def expire(self) -> int:
        """End the leases past their expiry; how many blocks went back to the engine."""
        now, num_blocks = self.clock(), 0
        for lease in list(self._leases.values()):
            if now >= lease.expires_at and not lease.is_ended:
                why = "expired" if lease.has_been_pulled else "unpulled"
                lease.is_ended, lease.why = True, lease.why or why
            num_blocks += self._release_if_idle(lease)
        return num_blocks

    def release_all(self) -> None:
        """At shutdown: every lease ends now."""
        for lease in list(self._leases.values()):
            lease.is_ended, lease.num_pulls, lease.why = True, 0, "shutdown"
            self._release_if_idle(lease)

    def _release_if_idle(self, lease: Lease) -> int:
        if lease.num_pulls > 0 or lease.is_released or not lease.is_ended:
            return 0
        lease.is_released = True
        del self._leases[lease.handle]
        self.release(lease.request_id)
        if self.on_release is not None:
            with contextlib.suppress(Exception):
                self.on_release(lease)
        return len(lease.held)


__all__ = ["Lease", "LeaseTable"]
