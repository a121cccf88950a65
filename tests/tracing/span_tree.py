"""Reading the spans a test exported: by name, by trace, and whether they form one tree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"  # the client's, sampled


@dataclass
class Spans:
    exporter: InMemorySpanExporter
    provider: TracerProvider

    def all(self) -> list[ReadableSpan]:
        self.provider.force_flush()
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]

    def names(self) -> set[str]:
        return {s.name for s in self.all()}


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_ids(spans: Sequence[ReadableSpan]) -> set[int]:
    return {s.context.trace_id for s in spans if s.context is not None}


def parent_of(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> ReadableSpan | None:
    """The span `span` names as its parent, among `spans` (None: a remote or no parent)."""
    if span.parent is None:
        return None
    return next((s for s in spans if span_id(s) == span.parent.span_id), None)


def orphans(spans: Sequence[ReadableSpan], root_parent_id: int) -> list[str]:
    """The spans whose parent is neither one of `spans` nor `root_parent_id` (the client's
    span): empty when `spans` hang together as one tree under the client's span."""
    ids = {span_id(s) for s in spans}
    return [s.name for s in spans
            if s.parent is None or (s.parent.span_id not in ids
                                    and s.parent.span_id != root_parent_id)]


def ancestors(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> list[str]:
    """The names from `span`'s parent up to the root."""
    names = []
    parent = parent_of(span, spans)
    while parent is not None:
        names.append(parent.name)
        parent = parent_of(parent, spans)
    return names
