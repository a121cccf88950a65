"""Forwarding one request: route, send, retry on another instance while nothing has reached the
client, then relay the answer.

An attempt fails (and counts toward outlier ejection) on a connect error, a timeout, a broken
connection or a 5xx before the first SSE frame (streams) or the whole body (non-streaming
answers, which are read fully before anything is sent). A 429 from an instance is retried without
counting as a failure. After the first frame has gone out, a failure is resumed on another
instance when the stream is resumable (strata/gateway/upstream/resume.py), else it ends the stream
with an error event and [DONE]. When every attempt failed, the client gets the last instance's 5xx
answer, or a 502 with an OpenAI error body; when no instance answered at all and the model's
fleet is down (restarting), it first waits for an instance to come back, up to the start wait
(strata/gateway/upstream/recovery.py). Every wait on an instance is watched for stalls
(strata/gateway/upstream/stalls.py): a dead socket fails its attempt within about a second.
With tracing on, each routing decision, attempt and resume is a span (traces.py), and each
attempt's request carries its `traceparent`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection

import httpx
from starlette.responses import Response

from strata import tracing
from strata.clock import Clock
from strata.errors import RequestFailedError
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.deadline import with_remaining
from strata.gateway.path.requests import ProxyRequest
from strata.gateway.routing.health import OutlierDetector
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.pipeline import RouteDecision, RoutingPipeline
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.stats import GatewayStats
from strata.gateway.upstream import traces
from strata.gateway.upstream.answer import UpstreamResponse
from strata.gateway.upstream.attempt import (
    UPSTREAM_ERRORS,
    Attempt,
    Failure,
    Segment,
    describe,
    frames_of,
    is_sse,
)
from strata.gateway.upstream.pools import (
    RelayResponse,
    UpstreamAnswer,
    UpstreamPools,
    broken_stream_frames,
    close_quietly,
    error_response,
    forwarded_headers,
    read_frames,
    response_headers,
)
from strata.gateway.upstream.recovery import Recovery
from strata.gateway.upstream.resume import Resumer, StreamRecord
from strata.gateway.upstream.retry import RetryBudget
from strata.gateway.upstream.stalls import StallWatch


class Proxy:
    """Routes and forwards requests; one per gateway app."""

    def __init__(self, pipeline: RoutingPipeline, upstreams: UpstreamPools,
                 detector: OutlierDetector, budget: RetryBudget, metrics: GatewayMetrics,
                 max_retries: int, resumer: Resumer, stalls: StallWatch,
                 clock: Clock = time.perf_counter, stats: GatewayStats | None = None,
                 recovery: Recovery | None = None,
                 prune_interval_s: float = 1.0) -> None:
        self.pipeline = pipeline
        self.upstreams = upstreams
        self.detector = detector
        self.budget = budget
        self.metrics = metrics
        self.max_retries = max_retries
        self.resumer = resumer
        self.stalls = stalls
        self.clock = clock
        self.stats = stats if stats is not None else GatewayStats()  # first bytes, stream gaps
        self.recovery = recovery  # None: no wait for a fleet that is coming back
        self.prune_interval_s = prune_interval_s  # how often pools of departed instances go
        self._pruned_at = clock()
        # every attempt's outcome: (instance, is_error, time to the first byte in s or None)
        self.observers: list[Callable[[InstanceView, bool, float | None], None]] = []

    async def forward(self, request: ProxyRequest) -> Response:
        """The client's response (a `RelayResponse` for a relayed stream). When no instance of
        the model answered at all, waits for one to come back and tries again (recovery.py)."""
        self.budget.record_request()
        deadline: float | None = None
        while True:
            tried: list[str] = []
            outcome = await self._attempts(request, tried)
            if isinstance(outcome, Response):
                return outcome
            failure, decision = outcome
            if self.recovery is None or (failure is not None and failure.response is not None) \
                    or (decision is not None and decision.status_code == 404):
                break  # an instance answered, or the model is unknown: nothing to wait for
            is_back, deadline = await self._wait_for_fleet(request.route, tried, deadline)
            if not is_back:
                break
        if failure is None and decision is not None:
            return self._no_route(decision)
        return self._give_up(failure)

    async def _wait_for_fleet(self, route: RouteRequest, tried: Collection[str],
                              deadline: float | None) -> tuple[bool, float]:
        """Waits until an instance that could take `route` is back (recovery.py), counted:
        (whether one is, the deadline). The first wait of a request sets its deadline; its
        later waits keep it, so a request never waits longer than --start-wait-s in all."""
        assert self.recovery is not None
        deadline = deadline if deadline is not None else self.recovery.deadline()
        num_waits = self.recovery.num_waits
        is_back = await self.recovery.wait(route, tried, deadline)
        if self.recovery.num_waits > num_waits:
            self.metrics.recovery_waits.labels("recovered" if is_back else "timed_out").inc()
        return is_back, deadline

    async def _attempts(self, request: ProxyRequest, tried: list[str]
                        ) -> Response | tuple[Failure | None, RouteDecision | None]:
        """One round of attempts on instances not tried yet (`tried` fills up): the response,
        or the last failure (and the routing decision that found no instance, if that ended the
        round)."""
        failure: Failure | None = None
        for attempt in range(self.max_retries + 1):
            if attempt > 0 and not await self._may_retry(attempt):
                break
            decision = traces.routed(self.pipeline, request.route, tried)
            if decision.instance is None:
                return failure, decision if failure is None else None
            tried.append(decision.instance.instance_id)
            outcome = await self._attempt(Attempt(decision.instance, request, attempt))
            if isinstance(outcome, Response):
                return outcome
            failure = outcome
        return failure, None

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
        if not tracing.is_on():  # the hot path: one check
            return await self._answer(attempt)
        with traces.attempt_span(attempt, "request") as opened:
            outcome = await self._answer(attempt)
            traces.attempt_ended(opened, outcome)
        return outcome

    async def _answer(self, attempt: Attempt) -> Response | Failure:
        response = await self._send(attempt)
        if isinstance(response, Failure):
            return response
        if attempt.request.route.is_stream and is_sse(response):
            return await self._open_stream(attempt, response)
        return await self._whole_body(attempt, response)

    async def _send(self, attempt: Attempt) -> UpstreamAnswer | Failure:
        """The instance's answer, unread; a failure for an error, a 5xx or a 429."""
        self._begin(attempt)
        request, watched = attempt.request, attempt.watched
        headers = self.resumer.headers(request, forwarded_headers(request.headers))
        headers = tracing.inject(headers)  # the instance's span: a child of this attempt's
        attempt.sent_at = self.clock()
        headers = with_remaining(headers, request.deadline_s, attempt.sent_at)
        if attempt.sent_at - self._pruned_at >= self.prune_interval_s:
            self._pruned_at = attempt.sent_at
            self.upstreams.prune(self.pipeline.instances)
        try:
            assert watched is not None
            response = await watched.wait(self.upstreams.send(
                attempt.view, request.method, request.path, request.body, headers))
        except UPSTREAM_ERRORS as exc:
            return self._failed(attempt, Failure(describe(attempt, exc)))
        if (response.status_code >= 500 or response.status_code == 429) \
                and response.headers.get("x-should-retry") != "false":
            return self._failed(attempt, await self._error_answer(attempt, response))
        return response  # an answer, or one no other instance would change (a deadline's 504)

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
            body = b"".join([chunk async for chunk in self._chunks(attempt, response)])
        except UPSTREAM_ERRORS as exc:
            return self._failed(attempt, Failure(describe(attempt, exc)))
        finally:
            await close_quietly(response)
        headers = response_headers(response, attempt.view.instance_id)
        self._finish(attempt, is_success=True)
        answered_at = self.clock()
        self._answered(attempt.view, answered_at - attempt.sent_at)
        self._observe_overhead(attempt, answered_at)
        return Response(body, response.status_code, headers=headers)

    async def _open_stream(self, attempt: Attempt, response: UpstreamAnswer) -> Response | Failure:
        segment = await self._first_frames(attempt, response)
        if isinstance(segment, Failure):
            return segment
        record = self.resumer.record(attempt.request, response, attempt.view.instance_id)
        relay = RelayResponse(self._relay(segment, record), response.status_code,
                              response_headers(response, attempt.view.instance_id))
        self._observe_overhead(attempt, self.clock())
        return relay

    async def _first_frames(self, attempt: Attempt,
                            response: UpstreamAnswer) -> Segment | Failure:
        chunks = self._chunks(attempt, response)
        try:
            first, rest, is_eof = await read_frames(chunks)
        except UPSTREAM_ERRORS as exc:
            await close_quietly(response)
            return self._failed(attempt, Failure(describe(attempt, exc)))
        self._answered(attempt.view, self.clock() - attempt.sent_at)
        return Segment(attempt, response, chunks, first, rest, is_eof)

    async def _relay(self, segment: Segment | None,
                     record: StreamRecord | None) -> AsyncIterator[bytes]:
        """The frames of `segment`, then of each resume after a break (marks removed)."""
        message, last_at = "", None
        while segment is not None:
            try:
                async for frames in frames_of(segment):
                    out = record.take(frames) if record is not None else frames
                    if out:
                        now = self.clock()
                        if last_at is not None:  # the gap the client sees between chunks
                            self.stats.gap(segment.attempt.view.pool, now - last_at)
                        last_at = now
                        yield out
                    if record is not None and record.has_failed:
                        record.has_failed = False
                        raise RequestFailedError("its engine failed on this stream")
                self._finish(segment.attempt, is_success=True)
                return
            except UPSTREAM_ERRORS as exc:
                message = f"the stream broke: {describe(segment.attempt, exc)}"
                self.metrics.broken_streams.inc()
                self.detector.record_failure(segment.attempt.view)
                self._notify(segment.attempt.view, True, None)
            finally:
                await close_quietly(segment.response)
                self._finish(segment.attempt, is_success=False)
            segment = await self._resume(record) if record is not None else None
        yield broken_stream_frames(record.explain(message) if record is not None else message)

    async def _resume(self, record: StreamRecord) -> Segment | None:
        """The continuation of a broken stream on an instance it has not tried, or None. When
        no instance could take it (the whole fleet died with the stream's instance), it waits
        for one to come back, as a request with nothing sent does (`forward`); a restarted
        instance may then be the one the stream broke on (a new process)."""
        request = self.resumer.next_request(record, self.clock())
        if request is None:
            return None
        with traces.resume_span(record) as opened:
            segment = await self._resumed(request, record)
            traces.resume_ended(opened, segment)
        return segment

    async def _resumed(self, request: ProxyRequest, record: StreamRecord) -> Segment | None:
        exclude, deadline = list(record.tried), None
        while True:
            outcome = await self._resume_round(request, record, exclude)
            if isinstance(outcome, Segment):
                self.metrics.resumes.labels("resumed").inc()
                return outcome
            if outcome is None or self.recovery is None:
                break  # refused, or an instance answered: nothing to wait for
            is_back, deadline = await self._wait_for_fleet(request.route, exclude, deadline)
            if not is_back:
                break
            exclude = []
        self.metrics.resumes.labels("failed").inc()
        return None

    async def _resume_round(self, request: ProxyRequest, record: StreamRecord,
                            exclude: list[str]) -> Segment | bool | None:
        """One round of resume attempts on instances not in `exclude` (it fills up): the
        resumed segment; None when refused, or when an instance answered with an error and no
        other did better (waiting would not help); True when no instance answered at all (the
        fleet may be coming back)."""
        is_answered = False
        for number in range(self.max_retries + 1):
            decision = traces.routed(self.pipeline, request.route, exclude)
            if decision.instance is None:
                break
            exclude.append(decision.instance.instance_id)
            record.tried.append(decision.instance.instance_id)
            attempt = Attempt(decision.instance, request, number)
            try:
                segment = await self._open_resumed(attempt, record)
            except BaseException:  # the client left meanwhile: the attempt ends with it
                self._finish(attempt, is_success=False)
                raise
            if isinstance(segment, Segment):
                return segment
            if segment is None:  # refused (another version, a conflict): no other try
                return None
            is_answered = is_answered or segment.response is not None
        return None if is_answered else True

    async def _open_resumed(self, attempt: Attempt,
                            record: StreamRecord) -> Segment | Failure | None:
        """The resumed stream's first frames; a failure (try elsewhere); None: it was refused."""
        with traces.attempt_span(attempt, "resume") as opened:
            outcome = await self._resumed_frames(attempt, record)
            traces.attempt_ended(opened, outcome)
        return outcome

    async def _resumed_frames(self, attempt: Attempt,
                              record: StreamRecord) -> Segment | Failure | None:
        response = await self._send(attempt)
        if isinstance(response, Failure):
            return response
        try:
            if is_sse(response):
                return await self._first_frames(attempt, response)
            await self.resumer.refused(record, attempt.view.instance_id, response)
        except BaseException:
            await close_quietly(response)
            raise
        await close_quietly(response)
        self._finish(attempt, is_success=True)
        return None

    def _chunks(self, attempt: Attempt, response: UpstreamAnswer) -> AsyncIterator[bytes]:
        chunks = response.aiter_raw()
        if attempt.watched is None:
            return chunks
        fail = response.fail if isinstance(response, UpstreamResponse) else None
        return attempt.watched.chunks(chunks, fail)

    def _begin(self, attempt: Attempt) -> None:
        view = attempt.view
        attempt.watched = self.stalls.open(view)
        attempt.in_flight = self.pipeline.sent(attempt.request.route, view)
        self.metrics.routed_by_instance.inc(view.instance_id)

    def _finish(self, attempt: Attempt, *, is_success: bool) -> None:
        if attempt.in_flight is None or attempt.is_finished:
            return
        if attempt.watched is not None:
            self.stalls.close(attempt.watched)
        if is_success:
            self.detector.record_success(attempt.view)
        self.pipeline.ended(attempt.request.route, attempt.in_flight, is_success=is_success)

    def _failed(self, attempt: Attempt, failure: Failure) -> Failure:
        self._finish(attempt, is_success=False)
        self.metrics.upstream_failures.labels(attempt.view.instance_id).inc()
        if failure.counts_as_failure:
            self.detector.record_failure(attempt.view)
            self._notify(attempt.view, True, None)
        return failure

    def _answered(self, view: InstanceView, ttfb_s: float) -> None:
        self.stats.first_byte(view.pool, ttfb_s)
        self._notify(view, False, ttfb_s)

    def _notify(self, view: InstanceView, is_error: bool, ttft_s: float | None) -> None:
        for observe in self.observers:
            observe(view, is_error, ttft_s)

    def _observe_overhead(self, attempt: Attempt, answer_at: float) -> None:
        before = attempt.sent_at - attempt.request.received_at
        after = self.clock() - answer_at
        self.metrics.added_latency.observe(max(0.0, before + after))


__all__ = ["Failure", "Proxy", "ProxyRequest"]
