"""Forwarding one request: route, send, retry on another instance while nothing has reached the
client, then relay the answer.

An attempt fails (and counts toward outlier ejection) on a connect error, a timeout, a broken
connection or a 5xx before the first SSE frame (streams) or the whole body (non-streaming
answers, which are read fully before anything is sent). A 429 from an instance is retried without
counting as a failure. After the first frame has gone out, a failure ends the stream with an error
event and [DONE]. When every attempt failed, the client gets the last instance's 5xx answer, or a
502 with an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
from starlette.responses import Response

from strata.gateway.health import OutlierDetector
from strata.gateway.instances import InstanceView
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipeline import RouteDecision, RoutingPipeline
from strata.gateway.policies.base import RouteRequest
from strata.gateway.retry import RetryBudget
from strata.gateway.upstream import (
    RelayResponse,
    UpstreamAnswer,
    UpstreamPools,
    broken_stream_frames,
    close_quietly,
    error_response,
    forwarded_headers,
    read_frames,
    response_headers,
    split_frames,
)

log = logging.getLogger("strata.gateway")
# What an attempt on an instance may raise besides httpx's errors (a transport closed under it,
# a socket error httpx did not wrap): all of them are the instance's failure, answered by a
# retry or a 502, never a 500.
UPSTREAM_ERRORS = (httpx.HTTPError, OSError, RuntimeError)


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A client request to forward: the body bytes go to the instance untouched."""

    method: str
    path: str
    body: bytes
    headers: list[tuple[str, str]]
    route: RouteRequest
    received_at: float


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
    sent_at: float = 0.0
    is_finished: bool = field(default=False)


class Proxy:
    """Routes and forwards requests; one per gateway app."""

    def __init__(self, pipeline: RoutingPipeline, upstreams: UpstreamPools,
                 detector: OutlierDetector, budget: RetryBudget, metrics: GatewayMetrics,
                 max_retries: int, clock: Callable[[], float] = time.perf_counter,
                 prune_interval_s: float = 1.0) -> None:
        self.pipeline = pipeline
        self.upstreams = upstreams
        self.detector = detector
        self.budget = budget
        self.metrics = metrics
        self.max_retries = max_retries
        self.clock = clock
        self.prune_interval_s = prune_interval_s  # how often pools of departed instances go
        self._pruned_at = clock()
        # every attempt's outcome: (instance, is_error, time to the first byte in s or None)
        self.observers: list[Callable[[InstanceView, bool, float | None], None]] = []

    async def forward(self, request: ProxyRequest) -> Response:
        """The client's response (a `RelayResponse` for a relayed stream)."""
        self.budget.record_request()
        tried: list[str] = []
        failure: Failure | None = None
        for attempt in range(self.max_retries + 1):
            if attempt > 0 and not await self._may_retry(attempt):
                break
            decision = self.pipeline.route(request.route, exclude=tried)
            if decision.instance is None:
                if failure is None:
                    return self._no_route(decision)
                break
            tried.append(decision.instance.instance_id)
            outcome = await self._attempt(Attempt(decision.instance, request))
            if isinstance(outcome, Response):
                return outcome
            failure = outcome
        return self._give_up(failure)

    async def _may_retry(self, attempt: int) -> bool:
        if not self.budget.try_spend():
            self.metrics.errors.labels("retry_budget").inc()
            return False
        self.metrics.retries.inc()
        await asyncio.sleep(self.budget.backoff_s(attempt - 1))
        return True

    def _no_route(self, decision: RouteDecision) -> Response:
        self.metrics.errors.labels(f"no_instance_{decision.status_code}").inc()
        retry_after_s = 1.0 if decision.status_code == 503 else None
        return error_response(decision.status_code, decision.reason, retry_after_s=retry_after_s)

    def _give_up(self, failure: Failure | None) -> Response:
        self.metrics.errors.labels("upstream").inc()
        if failure is not None and failure.response is not None:
            return failure.response
        message = failure.message if failure else "no instance could take the request"
        return error_response(502, message)

    async def _attempt(self, attempt: Attempt) -> Response | Failure:
        self._begin(attempt)
        request = attempt.request
        headers = forwarded_headers(request.headers)
        attempt.sent_at = self.clock()
        if attempt.sent_at - self._pruned_at >= self.prune_interval_s:
            self._pruned_at = attempt.sent_at
            self.upstreams.prune(self.pipeline.instances)
        try:
            response = await self.upstreams.send(attempt.view, request.method, request.path,
                                                 request.body, headers)
        except UPSTREAM_ERRORS as exc:
            return self._failed(attempt, Failure(_describe(attempt.view, exc)))
        if response.status_code >= 500 or response.status_code == 429:
            return self._failed(attempt, await self._error_answer(attempt, response))
        if request.route.is_stream and _is_sse(response):
            return await self._open_stream(attempt, response)
        return await self._whole_body(attempt, response)

    async def _error_answer(self, attempt: Attempt, response: UpstreamAnswer) -> Failure:
        try:
            body = await response.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await close_quietly(response)
        passthrough = Response(body, response.status_code,
                               headers=response_headers(response, attempt.view.instance_id))
        return Failure(f"instance {attempt.view.instance_id} answered {response.status_code}",
                       passthrough, counts_as_failure=response.status_code >= 500)

    async def _whole_body(self, attempt: Attempt, response: UpstreamAnswer) -> Response | Failure:
        try:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
        except UPSTREAM_ERRORS as exc:
            return self._failed(attempt, Failure(_describe(attempt.view, exc)))
        finally:
            await close_quietly(response)
        headers = response_headers(response, attempt.view.instance_id)
        self._finish(attempt, is_success=True)
        answered_at = self.clock()
        self._notify(attempt.view, False, answered_at - attempt.sent_at)
        self._observe_overhead(attempt, answered_at)
        return Response(body, response.status_code, headers=headers)

    async def _open_stream(self, attempt: Attempt, response: UpstreamAnswer) -> Response | Failure:
        chunks = response.aiter_raw()
        try:
            first, rest, is_eof = await read_frames(chunks)
        except UPSTREAM_ERRORS as exc:
            await close_quietly(response)
            return self._failed(attempt, Failure(_describe(attempt.view, exc)))
        first_at = self.clock()
        self._notify(attempt.view, False, first_at - attempt.sent_at)
        relay = RelayResponse(self._relay(attempt, response, chunks, first, rest, is_eof),
                              response.status_code,
                              response_headers(response, attempt.view.instance_id))
        self._observe_overhead(attempt, first_at)
        return relay

    async def _relay(self, attempt: Attempt, response: UpstreamAnswer,
                     chunks: AsyncIterator[bytes], first: bytes, rest: bytes,
                     is_eof: bool) -> AsyncIterator[bytes]:
        is_success = False
        try:
            yield first
            async for chunk in chunks if not is_eof else _empty():
                frames, rest = split_frames(rest + chunk)
                if frames:
                    yield frames
            if rest:
                yield rest
            is_success = True
        except UPSTREAM_ERRORS as exc:
            self.metrics.broken_streams.inc()
            self.detector.record_failure(attempt.view)
            self._notify(attempt.view, True, None)
            yield broken_stream_frames(f"the stream broke: {_describe(attempt.view, exc)}")
        finally:
            await close_quietly(response)
            self._finish(attempt, is_success=is_success)

    def _begin(self, attempt: Attempt) -> None:
        view, route = attempt.view, attempt.request.route
        view.num_in_flight += 1
        view.num_in_flight_tokens += route.num_tokens
        self.pipeline.policy.on_request_routed(route, view)
        self.metrics.routed_by_instance.inc(view.instance_id)

    def _finish(self, attempt: Attempt, *, is_success: bool) -> None:
        if attempt.is_finished:
            return
        attempt.is_finished = True
        view, route = attempt.view, attempt.request.route
        view.num_in_flight -= 1
        view.num_in_flight_tokens -= route.num_tokens
        if is_success:
            self.detector.record_success(view)
        self.pipeline.policy.on_request_finished(route, view, is_success=is_success)

    def _failed(self, attempt: Attempt, failure: Failure) -> Failure:
        self._finish(attempt, is_success=False)
        self.metrics.upstream_failures.labels(attempt.view.instance_id).inc()
        if failure.counts_as_failure:
            self.detector.record_failure(attempt.view)
            self._notify(attempt.view, True, None)
        return failure

    def _notify(self, view: InstanceView, is_error: bool, ttft_s: float | None) -> None:
        for observe in self.observers:
            observe(view, is_error, ttft_s)

    def _observe_overhead(self, attempt: Attempt, answer_at: float) -> None:
        before = attempt.sent_at - attempt.request.received_at
        after = self.clock() - answer_at
        self.metrics.added_latency.observe(max(0.0, before + after))


def _is_sse(response: UpstreamAnswer) -> bool:
    return (response.headers.get("content-type") or "").startswith("text/event-stream")


def _describe(view: InstanceView, exc: Exception) -> str:
    if not isinstance(exc, httpx.HTTPError):  # not the usual network error: keep its trace
        log.warning("instance %s: unexpected upstream error", view.instance_id, exc_info=exc)
    return f"instance {view.instance_id} failed: {type(exc).__name__}: {exc}"


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover


__all__ = ["Failure", "Proxy", "ProxyRequest"]
