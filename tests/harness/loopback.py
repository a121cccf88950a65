"""Plain-HTTP calls to the servers a test started on the loopback, without a TLS context.

`httpx.get(url)` builds a client per call, and with it an SSL context loaded with the CA bundle:
about 40 ms of CPU, whatever the URL. A `wait_until` that polls such a call every 50 ms spends
most of a core on it. For an http:// URL no TLS is ever spoken, so `verify=False` changes nothing
but that cost (about 1 ms a call); each call still opens a connection of its own, as before.

    loopback.get(f"{url}/metrics", timeout=5)      # as httpx.get
    loopback.instances(cluster)                    # as Cluster.instances()
"""

from __future__ import annotations

from typing import Any

import httpx


def _plain(url: str) -> str:
    if not url.startswith("http://"):
        raise ValueError(f"not a plain-HTTP URL: {url!r}")
    return url


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(_plain(url), verify=False, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(_plain(url), verify=False, **kwargs)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when GET `url` answers 200 (as harness.procs.http_ok)."""
    try:
        return get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def instances(cluster: Any) -> dict[str, dict]:
    """A `strata up` cluster's instances by id, as its gateway lists them (as Cluster.instances)."""
    body = get(f"{cluster.url}/admin/instances", timeout=5).json()
    return {i["instance_id"]: i for i in body["instances"]}
