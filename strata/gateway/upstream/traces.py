"""The proxy's spans (strata/tracing/): each routing decision, each attempt, each resume. Off,
every function here returns after one check and builds no attributes.

    strata.gateway.route     the policy, the chosen instance and its load, the candidates left,
                             or why no instance could take the request
    strata.gateway.attempt   one instance's attempt (number, kind: request or resume), until its
                             answer or first frames; the instance's span is its child
    strata.gateway.resume    one resume of a broken stream, around its attempts
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager

from opentelemetry.trace import Span, Status, StatusCode
from starlette.responses import Response

from strata import tracing
from strata.gateway.routing.pipeline import RouteDecision, RoutingPipeline
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.upstream.attempt import Attempt, Failure, Segment
from strata.gateway.upstream.resume import StreamRecord


def routed(pipeline: RoutingPipeline, route: RouteRequest,
           exclude: Collection[str]) -> RouteDecision:
    """`pipeline.route(route, exclude)`, in a span with the decision when tracing is on."""
    if not tracing.is_on():
        return pipeline.route(route, exclude=exclude)
    with tracing.span("strata.gateway.route") as opened:
        decision = pipeline.route(route, exclude=exclude)
        tracing.annotate(opened, **_decision(pipeline.policy.name, route, decision, exclude))
    return decision


def _decision(policy: str, route: RouteRequest, decision: RouteDecision,
              exclude: Collection[str]) -> dict[str, object]:
    view, num_candidates = decision.instance, decision.num_candidates
    if view is None:
        reason = decision.reason
    else:
        reason = (f"{policy} chose {view.instance_id} (load {view.request_load}) of "
                  f"{num_candidates} candidates")
    return {"strata.route.policy": policy, "strata.route.reason": reason,
            "strata.route.status_code": decision.status_code,
            "strata.route.num_candidates": num_candidates,
            "strata.route.num_excluded": len(exclude), "strata.route.role": route.role,
            "strata.route.pool": route.pool,
            "strata.instance.id": view.instance_id if view is not None else None,
            "strata.instance.load": view.request_load if view is not None else None}


def attempt_span(attempt: Attempt, kind: str) -> AbstractContextManager[Span | None]:
    """The span of one attempt (`kind`: request or resume), current while it is sent."""
    if not tracing.is_on():
        return tracing.span("")  # the shared no-op
    view = attempt.view
    return tracing.span("strata.gateway.attempt", {
        "strata.attempt.number": attempt.number, "strata.attempt.kind": kind,
        "strata.instance.id": view.instance_id, "strata.instance.role": view.role,
        "url.path": attempt.request.path})


def attempt_ended(opened: Span | None, outcome: Response | Segment | Failure | None) -> None:
    if opened is None:
        return
    if isinstance(outcome, Failure):
        opened.set_status(Status(StatusCode.ERROR, outcome.message))
        opened.set_attribute("strata.attempt.outcome", "failed")
    elif outcome is None:
        opened.set_attribute("strata.attempt.outcome", "refused")
    else:
        status = outcome.status_code if isinstance(outcome, Response) \
            else outcome.response.status_code
        opened.set_attributes({"strata.attempt.outcome": "answered",
                               "http.response.status_code": status})


def resume_span(record: StreamRecord) -> AbstractContextManager[Span | None]:
    """The span of one resume of `record` (its attempts are children)."""
    if not tracing.is_on():
        return tracing.span("")
    return tracing.span("strata.gateway.resume", {
        "strata.resume.number": record.num_resumes,
        "strata.resume.tried": list(record.tried)})


def resume_ended(opened: Span | None, segment: Segment | None) -> None:
    if opened is None:
        return
    opened.set_attribute("strata.resume.outcome", "resumed" if segment is not None else "failed")
    if segment is not None:
        opened.set_attribute("strata.instance.id", segment.attempt.view.instance_id)
    else:
        opened.set_status(Status(StatusCode.ERROR, "the stream could not be resumed"))


__all__ = ["attempt_ended", "attempt_span", "resume_ended", "resume_span", "routed"]
