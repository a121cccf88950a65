"""What tracing adds per request (issue 29 item 1: "no cost on the hot path when off"), timed
with `timeit` on the code tracing added, off and on; no servers.

    .venv/bin/python bench/tracing_overhead.py [--number 20000] [--repeat 7]

Per gateway request (a plain request: MeterTenants and Admit on the path, one attempt):
    off: Admit's admission-wait `span` (the shared no-op), `traces.routed`'s frame and check,
         `Proxy._attempt`'s check, `inject` on the upstream headers
    on:  the server span, a span per step, the admission wait, the routing decision with its
         attributes, the attempt, `inject` (spans exported in batches to an exporter that
         drops them); less the routing call and the attempt made without them
Per instance request: off, generation.start's `is_on()`; on, the server span and the engine's
spans of a timeline (one prefill chunk, a decode), emitted once the request ends.
Per decoded token (engine): off, the three `request.timeline is not None` checks on a token's
path (model input, update, append); on, those and `PhaseTimeline.token()`.
"on, unsampled": tracing on at --trace-sample-ratio 0, so every trace the gateway starts is
dropped: the server spans are made (non-recording), nothing under them is.

Prints ns per unit: the minimum over `--repeat` runs of `--number` calls (timeit's advice: the
minimum is the code's cost, the rest is the machine's noise).
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind
from starlette.responses import Response

from strata import tracing
from strata.engine.request import Request, SamplingParams
from strata.engine.timeline import PhaseTimeline
from strata.gateway.path.requests import ProxyRequest
from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.policies.round_robin import RoundRobinPolicy
from strata.gateway.upstream import traces
from strata.gateway.upstream.attempt import Attempt
from strata.server.phase_spans import emit
from strata.tracing.setup import current
from strata.types import RequestId


class Dropped(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


VIEWS = [InstanceView(f"i{n}", f"http://127.0.0.1:{9000 + n}", "m") for n in range(2)]
PIPELINE = RoutingPipeline(InstanceSet(VIEWS), RoundRobinPolicy())
ROUTE = RouteRequest(model="m", num_tokens=64)
HEADERS = [("content-type", "application/json"), ("x-request-id", "r1"),
           ("authorization", "Bearer k")]
REQUEST = ProxyRequest("POST", "/v1/chat/completions", b"{}", HEADERS, ROUTE, 0.0)
ANSWER = Response(b"{}", 200)


def gateway_direct() -> None:
    """The untraced calls `gateway_added` makes too (a routing decision, an attempt)."""
    decision = PIPELINE.route(ROUTE, exclude=())
    assert decision.instance is not None
    Attempt(decision.instance, REQUEST, 0)


def gateway_added() -> None:
    """The calls tracing put on a plain request's gateway path, around its one routing call."""
    with tracing.span("strata.gateway.admission_wait"):
        pass
    decision = traces.routed(PIPELINE, ROUTE, ())
    assert decision.instance is not None
    attempt = Attempt(decision.instance, REQUEST, 0)
    if tracing.is_on():  # Proxy._attempt's check; off, the attempt runs as before
        with traces.attempt_span(attempt, "request") as opened:
            traces.attempt_ended(opened, ANSWER)
    tracing.inject(HEADERS)


def routed_off(pipeline: RoutingPipeline, route: RouteRequest) -> None:
    """`traces.routed` off: a frame and a check around the routing call (not timed here)."""
    if not tracing.is_on():
        return


def gateway_off() -> None:
    """Exactly what tracing added to a plain request's gateway path, off."""
    with tracing.span("strata.gateway.admission_wait"):  # Admit
        pass
    routed_off(PIPELINE, ROUTE)  # Proxy._attempts
    tracing.is_on()  # Proxy._attempt
    tracing.inject(HEADERS)  # Proxy._send


def gateway_on() -> None:
    """`gateway_added` inside the server span and the two steps' spans (TraceRequests,
    TracedStep), as a traced request runs it."""
    assert current.tracer is not None
    with current.tracer.start_as_current_span("strata.gateway /v1/chat/completions",
                                              kind=SpanKind.SERVER,
                                              attributes={"url.path": "/v1/chat/completions"}):
        with tracing.span("strata.gateway.step.MeterTenants"), \
                tracing.span("strata.gateway.step.Admit"):
            gateway_added()


def instance_off() -> None:
    tracing.is_on()


ENGINE_REQUEST = Request(RequestId("r1"), list(range(64)), SamplingParams(max_tokens=16))


def instance_on() -> None:
    """The server span and the engine's spans of a finished request (one chunk, a decode)."""
    assert current.tracer is not None
    timeline = PhaseTimeline()
    timeline.admitted()
    timeline.chunk_submitted()
    timeline.chunk_done(64)
    timeline.token()
    timeline.finished("finished_length")
    with current.tracer.start_as_current_span("strata.instance /v1/chat/completions",
                                              kind=SpanKind.SERVER):
        emit(ENGINE_REQUEST, timeline)


def token_off() -> None:
    request = ENGINE_REQUEST
    if request.timeline is not None:  # model input
        pass
    if request.timeline is not None:  # update
        pass
    if request.timeline is not None:  # append
        request.timeline.token()


def token_on() -> None:
    request = ENGINE_REQUEST
    if request.timeline is not None:  # model input: not a prefill, nothing stamped
        pass
    if request.timeline is not None:  # update: idem
        pass
    if request.timeline is not None:  # append: the token counted
        request.timeline.token()


def empty() -> None:
    pass


def ns_per_call(fn: Callable[[], None], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    n, r = args.number, args.repeat
    assert not tracing.is_on()
    call = ns_per_call(empty, n, r)
    off = {"gateway request": ns_per_call(gateway_off, n, r) - call,
           "instance request": ns_per_call(instance_off, n, r) - call,
           "decoded token": ns_per_call(token_off, n, r) - call}
    direct = ns_per_call(gateway_direct, n, r)
    on = {ratio: on_costs(ratio, max(1, n // 10), r, direct, call) for ratio in (1.0, 0.0)}
    print(f"{'per':<18}{'off (ns)':>12}{'on (ns)':>12}{'on, unsampled (ns)':>20}")
    for unit in off:
        print(f"{unit:<18}{off[unit]:>12.0f}{on[1.0][unit]:>12.0f}{on[0.0][unit]:>20.0f}")


def on_costs(ratio: float, number: int, repeat: int, direct: float,
             call: float) -> dict[str, float]:
    """The on column at `ratio` (0: every trace the gateway starts is dropped, as most are at a
    low --trace-sample-ratio; the instance's spans are then children of an unsampled parent)."""
    config = tracing.TracingConfig("http://127.0.0.1:4318", sample_ratio=ratio)
    # a request of a dropped trace carries no timeline (phase_spans.traced)
    ENGINE_REQUEST.timeline = PhaseTimeline() if ratio else None
    tracing.start(tracing.tracer_provider(config, Dropped()))
    try:
        return {"gateway request": ns_per_call(gateway_on, number, repeat) - direct,
                "instance request": ns_per_call(instance_on, number, repeat) - call,
                "decoded token": ns_per_call(token_on, number * 10, repeat) - call}
    finally:
        tracing.stop()


if __name__ == "__main__":
    main()
