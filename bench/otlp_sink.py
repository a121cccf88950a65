"""A stand-in OTLP/HTTP collector for benchmarks: answers every POST at once with 200 and counts,
per request path, the exports and the spans in them; GET /counts returns those counts as JSON.

    .venv/bin/python bench/otlp_sink.py --port P

Give each traced process its own path (`--otlp-endpoint http://127.0.0.1:P/NAME`: an endpoint
with a path is used as it is) to count its spans apart. Listens on 127.0.0.1 only; the same
collector as tests/tracing/test_otlp_export.py, in a process of its own so that decoding the
spans takes no time from the process driving the load.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

_lock = threading.Lock()
_counts: dict[str, dict[str, int]] = {}


def count_spans(body: bytes) -> int:
    sent = ExportTraceServiceRequest.FromString(body)
    return sum(len(scope.spans) for rs in sent.resource_spans for scope in rs.scope_spans)


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer(200, b"", "application/x-protobuf")
        spans = count_spans(body)
        with _lock:
            row = _counts.setdefault(self.path, {"exports": 0, "spans": 0})
            row["exports"] += 1
            row["spans"] += spans

    def do_GET(self) -> None:  # noqa: N802
        with _lock:
            body = json.dumps(_counts).encode()
        self._answer(200 if self.path == "/counts" else 404, body, "application/json")

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Sink)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
