"""Cancellation at the gateway: a client that leaves, a request past its deadline.

    deadline  `X-Strata-Timeout-S`, else the body's `timeout` (strata/protocol/deadline.py),
              from the moment the request entered (`ProxyRequest.deadline_s`, on the proxy's
              clock). Every instance the request is sent to (decode, a hand-off's prefill, a
              resume) gets what remains in the header (`with_remaining`), so each aborts its own
              work at the same moment even when the gateway cannot tell it
    wait      `until_cancelled`: the whole path runs under the deadline, in the request's task;
              past the deadline it is cancelled (its upstream connections close: the instances
              see their client go) and the client gets a 504 `deadline_exceeded`; a client that
              leaves before the answer cancels it too (the instance aborts its engine requests,
              a hand-off's prefill instance releases the blocks it held for the handle)
    stream    a relayed stream past its deadline ends with a 504 error event and [DONE]; one
              whose client left is closed by `RelayResponse` (pools.py)
    count     strata:gateway_requests_cancelled_total{reason}: client_disconnect, deadline
              (the gateway's own, or an instance's 504 that came first)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive

from strata.clock import Clock
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.requests import ProxyRequest
from strata.gateway.upstream.pools import ClientWatch, RelayResponse
from strata.protocol.deadline import TIMEOUT_HEADER, remaining_header
from strata.protocol.errors import error_json, error_payload
from strata.protocol.sse import DONE_FRAME, encode_event

DEADLINE_MESSAGE = "the request's deadline passed before its answer was complete"
CLIENT_DISCONNECT, DEADLINE = "client_disconnect", "deadline"


def with_remaining(headers: list[tuple[str, str]], deadline_s: float | None,
                   now_s: float) -> list[tuple[str, str]]:
    """`headers` with the client's timeout replaced by what remains of the deadline."""
    if deadline_s is None:
        return headers
    kept = [(k, v) for k, v in headers if k.lower() != TIMEOUT_HEADER]
    return [*kept, remaining_header(deadline_s, now_s)]


def deadline_response() -> Response:
    """504 `deadline_exceeded`, not to be retried (a retry would miss the deadline again)."""
    body = error_json(504, DEADLINE_MESSAGE, kind="timeout_error", code="deadline_exceeded")
    return Response(body, 504, media_type="application/json",
                    headers={"x-should-retry": "false"})


def is_deadline_answer(response: Response) -> bool:
    """A 504 that says not to retry it: a deadline's, the gateway's or an instance's."""
    return response.status_code == 504 and response.headers.get("x-should-retry") == "false"


async def until_cancelled(request: ProxyRequest, forward: Callable[[ProxyRequest],
                                                                   Awaitable[Response]],
                          receive: Receive, metrics: GatewayMetrics, clock: Clock) -> Response:
    """`forward(request)`, cancelled when the deadline passes (a 504) or the client leaves
    (an answer nobody reads); a relayed stream is watched until it ends. `forward` runs in the
    request's own task (no task to start and wait on: the hot path's first send is not delayed
    by a turn of the loop); a `ClientWatch` on `receive` cancels it when the client leaves."""
    watch = ClientWatch(receive)
    remaining = None if request.deadline_s is None else request.deadline_s - clock()
    timeout = asyncio.timeout(remaining)
    try:
        async with timeout:
            response = await forward(request)
    except TimeoutError:
        if not timeout.expired():
            raise
        metrics.cancelled.labels(DEADLINE).inc()
        return deadline_response()
    except asyncio.CancelledError:
        if not watch.was_only_cause():
            raise
        metrics.cancelled.labels(CLIENT_DISCONNECT).inc()
        return Response(status_code=499)
    finally:
        watch.stop()
    if is_deadline_answer(response):  # an instance's clock ran out first
        metrics.cancelled.labels(DEADLINE).inc()
    return _watched(response, request, metrics, clock)


def _watched(response: Response, request: ProxyRequest, metrics: GatewayMetrics,
             clock: Clock) -> Response:
    if not isinstance(response, RelayResponse):
        return response

    def counted() -> None:
        if response.is_disconnected:
            metrics.cancelled.labels(CLIENT_DISCONNECT).inc()

    response.on_close.append(counted)
    deadline_s = request.deadline_s
    if deadline_s is not None:
        response.relay_through(lambda frames: _until(frames, deadline_s, metrics, clock))
    return response


async def _until(frames: AsyncIterator[bytes], deadline_s: float, metrics: GatewayMetrics,
                 clock: Clock) -> AsyncIterator[bytes]:
    """The frames until the deadline, then an error event and [DONE] (the relay closed: its
    instance sees its client go)."""
    try:
        while True:
            try:
                async with asyncio.timeout(deadline_s - clock()):  # in this task: the relay
                    frame = await anext(frames)  # ends with it (never left running)
            except StopAsyncIteration:
                return
            except TimeoutError:
                metrics.cancelled.labels(DEADLINE).inc()
                yield encode_event(error_payload(504, DEADLINE_MESSAGE, kind="timeout_error",
                                                 code="deadline_exceeded")) + DONE_FRAME
                return
            yield frame
    finally:
        aclose = getattr(frames, "aclose", None)
        if aclose is not None:
            await aclose()


__all__ = ["DEADLINE_MESSAGE", "deadline_response", "until_cancelled", "with_remaining"]
