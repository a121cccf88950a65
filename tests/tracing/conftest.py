"""Fixtures of the tracing tests: tracing on, exporting to the SDK's in-memory exporter, for one
test at a time (`tracing.stop()` after it, so that no other test's apps trace anything)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
for folder in ("server", "gateway", "pd"):
    sys.path.insert(0, str(HERE.parent / folder))

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from span_tree import Spans  # noqa: E402

from strata import tracing  # noqa: E402


@pytest.fixture
def spans() -> Iterator[Spans]:
    """Tracing on (every trace sampled) for the apps the test builds; the spans they export."""
    exporter = InMemorySpanExporter()
    provider = tracing.tracer_provider(tracing.TracingConfig("http://127.0.0.1:4318"), exporter)
    tracing.start(provider)
    yield Spans(exporter, provider)
    tracing.stop()
