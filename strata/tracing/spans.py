"""The calls the gateway and the server make. Each costs one check when tracing is off:

    with span("strata.gateway.attempt", {...}) as s:   a child of the current span (s: None off)
    annotate(s, key=value)                             attributes on a span, when there is one
    note({...})                                        attributes on the current span
    headers = inject(headers)                          `traceparent` of the current span added
    event_hooks={"request": [inject_into]}             the same, on every call of an httpx client
    record("strata.engine.decode", start_ns, end_ns)   a span after the fact (engine phases)

`inject` replaces any `traceparent`/`tracestate` the headers carry (a client's, forwarded): the
instance's span is the child of the gateway's attempt, not of the client's span.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import httpx
from opentelemetry import trace
from opentelemetry.context import Context, get_current
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from strata.tracing.setup import current

PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = frozenset(PROPAGATOR.fields)  # traceparent, tracestate
Attributes = Mapping[str, Any]
_OFF: AbstractContextManager[None] = nullcontext()


def span(name: str, attributes: Attributes | None = None,
         kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Span | None]:
    """A span over the `with` block, current inside it; off, or inside a trace that is not
    sampled: a shared no-op (yields None)."""
    if current.tracer is None or is_unsampled():
        return _OFF
    return _span(name, attributes, kind)


@contextmanager
def _span(name: str, attributes: Attributes | None, kind: SpanKind) -> Iterator[Span | None]:
    assert current.tracer is not None
    with current.tracer.start_as_current_span(name, kind=kind,
                                              attributes=_clean(attributes)) as opened:
        yield opened


def current_trace_id() -> str | None:
    """The current span's trace id (32 hex digits) when tracing is on and the trace is
    sampled, else None: what an operator looks up in the trace store."""
    if current.tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return format(context.trace_id, "032x")


def annotate(opened: Span | None, **attributes: Any) -> None:
    """Set `attributes` (None values left out) on `opened`, a span `span` yielded."""
    if opened is not None:
        opened.set_attributes(_clean(attributes) or {})


def note(attributes: Attributes) -> None:
    """Set `attributes` on the current span (a path step's); callers build them only when
    `is_on()`, so that nothing is allocated when tracing is off."""
    if current.tracer is not None:
        trace.get_current_span().set_attributes(_clean(attributes) or {})


def inject(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` with the current span's `traceparent` (off, or outside a span: unchanged)."""
    if current.tracer is None:
        return headers
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    if not carrier:
        return headers
    kept = [(k, v) for k, v in headers if k.lower() not in TRACE_HEADERS]
    return [*kept, *carrier.items()]


async def inject_into(request: httpx.Request) -> None:
    """An httpx request hook (`event_hooks={"request": [inject_into]}`): every request of
    the client carries the current span's `traceparent`."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    request.headers.update(carrier)


def extract(headers: Sequence[tuple[bytes, bytes]]) -> Context:
    """The remote parent named by raw ASGI headers' `traceparent` (an empty context if none)."""
    carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers
               if k.lower() in _TRACE_HEADER_BYTES}
    return PROPAGATOR.extract(carrier)


_TRACE_HEADER_BYTES = frozenset(name.encode() for name in TRACE_HEADERS)


def parent_context() -> Context | None:
    """The current context, to parent spans recorded later elsewhere (None: off)."""
    return None if current.tracer is None else get_current()


def record(name: str, start_ns: int, end_ns: int, attributes: Attributes | None = None,
           parent: Context | None = None) -> Span | None:
    """A span that already happened, from `start_ns` to `end_ns` (time.time_ns), under
    `parent` (else the current span); returned, ended, so that children can name it."""
    if current.tracer is None or is_unsampled(parent):
        return None
    opened = current.tracer.start_span(name, context=parent, attributes=_clean(attributes),
                                       start_time=start_ns)
    opened.end(end_time=max(start_ns, end_ns))
    return opened


def is_unsampled(parent: Context | None = None) -> bool:
    """Whether the current span (or `parent`'s) belongs to a trace the sampler dropped: its
    children would record nothing, so none is made (the dropped span's `traceparent` still
    goes downstream, flags 00, and every instance drops the trace too)."""
    context = trace.get_current_span(parent).get_span_context()
    return context.is_valid and not context.trace_flags.sampled


def under(parent: Span) -> Context:
    """A context whose current span is `parent` (for `record`'s children)."""
    return trace.set_span_in_context(parent)


def _clean(attributes: Attributes | None) -> dict[str, Any] | None:
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}


__all__ = ["PROPAGATOR", "TRACE_HEADERS", "annotate", "extract", "inject", "inject_into",
           "is_unsampled", "note", "parent_context", "record", "span", "under"]
