"""HTTP from tests through one kept-alive `httpx.Client` per thread, instead of `httpx.get(...)`.

Each module-level `httpx.get`/`httpx.post` builds a fresh client, and with it a TLS context that
loads the CA bundle: about 30 ms of CPU per call, even to a plain http:// URL on the loopback.
A test that polls every 50 ms spends most of a core on that alone. The requests here are the
same requests (method, URL, body, headers, timeout); the client keeps no cookies between them,
so no answer can change what the next request sends.

    from harness import pooled_http as http
    http.get(url, timeout=5); http.post(url, json=body); http.request("DELETE", url)
    http.ok(url)  # GET answers 200 (False on a connection error), like procs.http_ok
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import httpx

_local = threading.local()
_made: list[httpx.Client] = []  # closed at exit (their kept-alive sockets with them)


def client() -> httpx.Client:
    """This thread's client (made on first use; requests pass their own timeouts)."""
    found: httpx.Client | None = getattr(_local, "client", None)
    if found is None:
        found = httpx.Client(timeout=30.0)
        _local.client = found
        _made.append(found)
    return found


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    """`httpx.request(method, url, **kwargs)` on this thread's client (no cookies kept)."""
    pooled = client()
    try:
        return pooled.request(method, url, **kwargs)
    finally:
        pooled.cookies.clear()


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200 (`harness.procs.http_ok`, pooled)."""
    try:
        return get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


@atexit.register
def _close_all() -> None:
    for made in _made:
        made.close()


__all__ = ["client", "get", "ok", "post", "request"]
