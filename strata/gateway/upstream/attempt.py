"""One attempt of the proxy on one instance (strata/gateway/upstream/proxy.py): what it holds, how
it failed, and the part of a stream it relays.

An attempt fails on any of `UPSTREAM_ERRORS`: httpx's errors, and what an attempt may raise
besides them (a transport closed under it, a socket error httpx did not wrap, the
`TimeoutError` of a wait the stall watch ended): all of them are the instance's failure,
answered by a retry, a resume or a 502, never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from strata.errors import RequestFailedError
from strata.gateway.path.requests import ProxyRequest
from strata.gateway.routing.instances import InFlight, InstanceView
from strata.gateway.upstream.pools import UpstreamAnswer, split_frames
from strata.gateway.upstream.stalls import Watched

log = logging.getLogger("strata.gateway")
# RequestFailedError: the instance ended a resumable stream with finish reason "error"
UPSTREAM_ERRORS = (httpx.HTTPError, OSError, RuntimeError, RequestFailedError)


@dataclass(slots=True)
class Failure:
    """A failed attempt: the instance's own answer when it gave one (5xx, 429)."""

    message: str
    response: Response | None = None
    counts_as_failure: bool = True


@dataclass(slots=True)
class Attempt:
    view: InstanceView
    request: ProxyRequest
    number: int = 0  # of the request's (or the resume's) attempts, from 0
    sent_at: float = 0.0
    in_flight: InFlight | None = None  # counted in flight from the send until it ends
    watched: Watched | None = None  # while in flight

    @property
    def is_finished(self) -> bool:
        return self.in_flight is not None and not self.in_flight.is_open


@dataclass(slots=True)
class Segment:
    """One instance's part of a relayed stream, its first frames read."""

    attempt: Attempt
    response: UpstreamAnswer
    chunks: AsyncIterator[bytes]
    first: bytes
    rest: bytes
    is_eof: bool


def is_sse(response: UpstreamAnswer) -> bool:
    return (response.headers.get("content-type") or "").startswith("text/event-stream")


def describe(attempt: Attempt, exc: Exception) -> str:
    """Why `attempt` failed, for the log and the client's error."""
    view = attempt.view
    if attempt.watched is not None and attempt.watched.was_ended:
        return f"instance {view.instance_id} went silent and failed a health probe"
    if not isinstance(exc, httpx.HTTPError | RequestFailedError):  # unexpected: keep its trace
        log.warning("instance %s: unexpected upstream error", view.instance_id, exc_info=exc)
    return f"instance {view.instance_id} failed: {type(exc).__name__}: {exc}"


async def frames_of(segment: Segment) -> AsyncIterator[bytes]:
    """Whole SSE frames of one segment (the last piece as it is, at the end)."""
    yield segment.first
    rest = segment.rest
    if not segment.is_eof:
        async for chunk in segment.chunks:
            frames, rest = split_frames(rest + chunk)
            if frames:
                yield frames
    if rest:
        yield rest


__all__ = ["UPSTREAM_ERRORS", "Attempt", "Failure", "Segment", "describe",
           "frames_of", "is_sse"]
