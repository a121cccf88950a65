"""The engine's phases of a traced request, as spans (strata/tracing/__init__.py lists them).

`traced` gives each engine request a `PhaseTimeline` and wraps its output stream: once the
stream ends (finished, failed or closed by a client that left), the timeline becomes one
`strata.engine.request` span with a child per phase, under the span that was current when the
generation started (the instance's server span, or the P/D route's). Off, `generation.start`
never calls it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from opentelemetry.context import Context

from strata.engine.outputs import RequestOutput
from strata.engine.request import Request
from strata.engine.timeline import PhaseTimeline
from strata.tracing.spans import is_unsampled, parent_context, record, under

Outputs = AsyncGenerator[RequestOutput, None]


def traced(request: Request, stream: Outputs) -> Outputs:
    """`stream` of `request`, its phases recorded as spans when it ends (a request of a trace
    the sampler dropped: `stream` as it is, its request unstamped)."""
    if is_unsampled():
        return stream
    request.timeline = PhaseTimeline()
    return _recording(request, request.timeline, stream, parent_context())


async def _recording(request: Request, timeline: PhaseTimeline, stream: Outputs,
                     parent: Context | None) -> Outputs:
    try:
        async for output in stream:
            yield output
    finally:
        await stream.aclose()
        emit(request, timeline, parent)


def emit(request: Request, timeline: PhaseTimeline, parent: Context | None = None) -> None:
    """The spans of one request's timeline (its end: the finish, else now)."""
    end_ns = timeline.finished_ns or timeline.clock_ns()
    root = record("strata.engine.request", timeline.arrived_ns, end_ns, {
        "strata.engine.request_id": request.request_id,
        "strata.engine.num_prompt_tokens": request.num_prompt_tokens,
        "strata.engine.num_cached_tokens": request.num_reported_cached_tokens,
        "strata.engine.num_output_tokens": request.num_output_tokens,
        "strata.engine.num_preemptions": request.num_preemptions,
        "strata.engine.finish": timeline.finish or "unfinished",
        "strata.engine.is_handoff": request.handoff is not None}, parent)
    if root is None:
        return
    inside = under(root)
    record("strata.engine.queue_wait", timeline.arrived_ns, timeline.admitted_ns or end_ns,
           None, inside)
    for mark in timeline.imports:
        record("strata.engine.kv_import", mark.at_ns, mark.end_ns,
               {"strata.kv.num_blocks": mark.num_blocks,
                "strata.kv.num_imported": mark.num_imported}, inside)
    for i, chunk in enumerate(timeline.chunks):
        record("strata.engine.prefill_chunk", chunk.start_ns, chunk.end_ns,
               {"strata.engine.chunk": i, "strata.engine.num_tokens": chunk.num_tokens}, inside)
    if timeline.first_token_ns is not None:
        record("strata.engine.decode", timeline.first_token_ns, end_ns,
               {"strata.engine.num_tokens": timeline.num_tokens}, inside)
    for at_ns, readmitted_ns in timeline.preemptions:
        record("strata.engine.preempted", at_ns, readmitted_ns or end_ns, None, inside)


__all__ = ["emit", "traced"]
