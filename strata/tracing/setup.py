"""Turning tracing on: the flags' config, the tracer provider and its exporter.

A process has one tracer at most, held here (`current`), so that the gateway's path, the
instance's routes and the server's engine spans find it without threading it through every
constructor; the global OpenTelemetry provider is left alone, so a library's own
instrumentation is not switched on behind Strata's flags, and tests can start and stop tracing
between stories.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Tracer

from strata.errors import ConfigError

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, added to an endpoint given without one


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """`otlp_endpoint`: the collector's OTLP/HTTP URL (None: tracing off); `sample_ratio`: the
    share of traces kept when this process starts them (a request that comes with a sampled
    `traceparent` is kept whatever the ratio)."""

    otlp_endpoint: str | None = None
    sample_ratio: float = 1.0
    service_name: str = "strata"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"--trace-sample-ratio must be in [0, 1], got {self.sample_ratio}")
        if self.otlp_endpoint is not None:
            parts = urlsplit(self.otlp_endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"--otlp-endpoint must be an http:// or https:// URL (the "
                                  f"collector's OTLP/HTTP port, e.g. http://127.0.0.1:4318), "
                                  f"got {self.otlp_endpoint!r}")

    @property
    def is_on(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def traces_url(self) -> str:
        """The exporter's URL: the endpoint, with /v1/traces when it names no path."""
        assert self.otlp_endpoint is not None
        endpoint = self.otlp_endpoint.rstrip("/")
        return endpoint if urlsplit(endpoint).path else endpoint + TRACES_PATH


def tracer_provider(config: TracingConfig, exporter: SpanExporter | None = None
                    ) -> TracerProvider:
    """A provider sampling parent-based at `config.sample_ratio`, exporting in batches to
    `exporter`, else to the OTLP/HTTP exporter at `config.traces_url`."""
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.traces_url)
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
                              resource=Resource.create({"service.name": config.service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class _Current:
    tracer: Tracer | None = None
    provider: TracerProvider | None = None


current = _Current()


def start(provider: TracerProvider) -> None:
    """Trace this process's requests with `provider` (apps built afterwards install their
    middleware and path wrappers)."""
    current.provider = provider
    current.tracer = provider.get_tracer("strata")


def stop() -> None:
    """Flush and end tracing; apps built afterwards trace nothing."""
    provider, current.provider, current.tracer = current.provider, None, None
    if provider is not None:
        provider.shutdown()


def is_on() -> bool:
    return current.tracer is not None


__all__ = ["TracingConfig", "current", "is_on", "start", "stop", "tracer_provider"]
