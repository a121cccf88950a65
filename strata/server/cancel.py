"""What ends a client request on this instance before its answer is whole: the client leaving,
or its deadline passing (strata/protocol/deadline.py).

    set     the one door (preamble.py) reads the deadline once: `X-Strata-Timeout-S` (what the
            gateway says remains), else the body's `timeout`; every route reads it back here
    wait    `unless_cancelled(request, work)`: client gone -> ClientDisconnect (499), deadline
            -> DeadlineExceededError (504); either cancels `work`, and cancelling it closes
            its engine streams, which posts the abort: the engine thread applies it at its next
            command pass, before its next step, and the aborted request's blocks go back to
            the free pool there (a P/D hand-off's held blocks: pd/prefill.py releases them)
    stream  `Cancel.frames`: a stream past its deadline ends with a 504 error event and
            [DONE]; a stream its client left is closed by SSEResponse (request_io.py)
    count   strata:requests_cancelled_total{model_name, reason}: once per request, by the
            first reason (client_disconnect, deadline)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from strata.clock import Clock
from strata.errors import DeadlineExceededError
from strata.protocol.deadline import TIMEOUT_HEADER, request_timeout_s
from strata.protocol.errors import describe
from strata.protocol.sse import DONE_FRAME, encode_event

T = TypeVar("T")
CANCEL_STATE = "strata_cancel"  # ASGI scope["state"] key set by the one door
DISCONNECT_POLL_S = 0.25  # how often a waiting route asks whether its client is still there
CLIENT_DISCONNECT, DEADLINE = "client_disconnect", "deadline"


@dataclass(slots=True)
class Cancel:
    """One request's deadline (on `clock`, None: none) and why it was cancelled, if it was."""

    deadline_s: float | None
    clock: Clock
    count: Callable[[str], None]  # the metric, by reason
    reason: str | None = None

    def remaining_s(self) -> float | None:
        return None if self.deadline_s is None else self.deadline_s - self.clock()

    @property
    def is_expired(self) -> bool:
        remaining = self.remaining_s()
        return remaining is not None and remaining <= 0

    def note(self, reason: str) -> None:
        """Counted once, by the first reason."""
        if self.reason is None:
            self.reason = reason
            self.count(reason)

    def expired(self) -> DeadlineExceededError:
        self.note(DEADLINE)
        return DeadlineExceededError("the request's deadline passed before its answer was "
                                     "complete; its work was aborted")

    async def frames(self, frames: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """`frames` until the deadline; then an error event and [DONE] (the frames closed,
        which aborts their engine requests). No deadline: `frames` as they are."""
        try:
            while True:
                try:
                    async with asyncio.timeout(self.remaining_s()):  # in this task: the
                        frame = await anext(frames)  # frames end with it (never still running)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    yield encode_event(describe(self.expired()).payload()) + DONE_FRAME
                    return
                yield frame
        finally:
            await frames.aclose()


def watch(request: Request, header: str | None, body_timeout: object, clock: Clock,
          count: Callable[[str], None]) -> Cancel:
    """The request's `Cancel`, its deadline starting now; kept on the request's scope."""
    timeout_s = request_timeout_s(header, body_timeout)
    cancel = Cancel(None if timeout_s is None else clock() + timeout_s, clock, count)
    request.scope.setdefault("state", {})[CANCEL_STATE] = cancel
    return cancel


def cancel_of(request: Request) -> Cancel:
    """The `Cancel` the one door set (a request that did not enter by it: no deadline)."""
    cancel = request.scope.get("state", {}).get(CANCEL_STATE)
    if isinstance(cancel, Cancel):
        return cancel
    serving = request.app.state.instance.serving  # instance_of's; instance.py imports us
    return watch(request, None, None, serving.clock, serving.metrics.observe_cancelled)


async def unless_cancelled(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves
    (ClientDisconnect) or the deadline passes (DeadlineExceededError)."""
    cancel = cancel_of(request)
    task = asyncio.ensure_future(work)
    try:
        while True:
            remaining = cancel.remaining_s()
            wait_s = DISCONNECT_POLL_S if remaining is None \
                else max(0.0, min(DISCONNECT_POLL_S, remaining))
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if done:
                return task.result()
            if cancel.is_expired:
                raise cancel.expired()
            if await request.is_disconnected():
                cancel.note(CLIENT_DISCONNECT)
                raise ClientDisconnect()
    finally:
        task.cancel()


__all__ = ["CANCEL_STATE", "CLIENT_DISCONNECT", "DEADLINE", "TIMEOUT_HEADER", "Cancel",
           "cancel_of", "unless_cancelled", "watch"]
