"""The real exporter: `--otlp-endpoint` sends spans over OTLP/HTTP (protobuf) to the collector's
/v1/traces, here a collector stand-in on 127.0.0.1 that decodes what it receives."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from strata import tracing


class Collector(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["content-length"]))
        Collector.received.append((self.path, self.headers["content-type"], body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    Collector.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_spans_reach_the_collector_over_otlp_http(collector: str) -> None:
    config = tracing.TracingConfig(collector, service_name="strata-gateway")
    tracing.start(tracing.tracer_provider(config))
    try:
        with tracing.span("strata.gateway.route", {"strata.route.policy": "round_robin"}):
            pass
    finally:
        tracing.stop()  # flushes the batch
    (path, content_type, body), = Collector.received
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    sent = ExportTraceServiceRequest.FromString(body)
    resource = sent.resource_spans[0]
    assert {a.key: a.value.string_value for a in resource.resource.attributes}[
        "service.name"] == "strata-gateway"
    span, = resource.scope_spans[0].spans
    assert span.name == "strata.gateway.route"
    assert [(a.key, a.value.string_value) for a in span.attributes] == [
        ("strata.route.policy", "round_robin")]
