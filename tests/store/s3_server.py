"""A real S3-compatible server (moto's server mode) on a free 127.0.0.1 port, counting requests."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from moto.server import DomainDispatcherApplication, ThreadedMotoServer, create_backend_app
from werkzeug.serving import make_server

from strata.store import S3Config

DUMMY = S3Config(region_name="us-east-1", access_key_id="testing", secret_access_key="testing")


class CountingMotoServer(ThreadedMotoServer):
    """ThreadedMotoServer whose WSGI app counts (method, path) of every request."""

    def __init__(self) -> None:
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.requests: Counter[tuple[str, str]] = Counter()
        self._count_lock = threading.Lock()

    def _server_entry(self) -> None:
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
            with self._count_lock:
                self.requests[(environ["REQUEST_METHOD"], environ["PATH_INFO"])] += 1
            return app(environ, start)

        self._server = make_server("127.0.0.1", 0, counting, True)
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def url(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"

    def gets(self, path: str) -> int:
        return self.requests[("GET", path)]
