"""Every route of the instance and of the gateway, read from their route tables (a new route is
tried the day it is added), called with no key, a client key, another tenant's client key and
the admin key, against real keyed processes:

    probes and the dashboard       open to all
    /admin/*                       401 without a key, 403 with a client key, served to the admin
    everything else                401 without a key, served to any client key and the admin

and no call, whatever its key, is answered with a 5xx.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sim_stack import ADMIN_KEY, CLIENT_KEY, MODEL, OTHER_CLIENT_KEY, Targets
from starlette.routing import Route

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.control.dashboard.page import DASHBOARD_PATHS, STATIC
from strata.gateway.routing.sources import StaticSource
from strata.protocol.auth import ADMIN_PREFIX, EXEMPT_PATHS
from strata.server.app import build_routes as instance_routes

KEYS = {"none": None, "client": CLIENT_KEY, "other tenant": OTHER_CLIENT_KEY, "admin": ADMIN_KEY}
PATH_PARAMS = {"session_id": "no-such-session", "instance_id": "INSTANCE", "release_id": "r-0",
               "name": "dashboard.js", "handle": "no-such-handle"}  # name each path parameter
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 1,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}


def routes_of(routes: list[Any]) -> list[tuple[str, str]]:
    """(method, path template) of every route, the drains last (they stop the instance)."""
    found = {(method, route.path) for route in routes if isinstance(route, Route)
             for method in route.methods or () if method != "HEAD"}
    return sorted(found, key=lambda r: ("drain" in r[1], r))


def gateway_routes() -> list[tuple[str, str]]:
    source = StaticSource(("http://127.0.0.1:9",), httpx.AsyncClient())
    return routes_of(create_gateway_app(GatewayConfig(), source, run_background=False).routes)


ROUTES = sorted([("instance", *r) for r in routes_of(instance_routes())]
                + [("gateway", *r) for r in gateway_routes()],
                key=lambda r: "drain" in r[2])  # the drains last: they stop the instance


def kind_of(path: str) -> str:
    if path in EXEMPT_PATHS or path in DASHBOARD_PATHS or path.startswith(STATIC):
        return "open"
    return "admin" if path.startswith(ADMIN_PREFIX) else "client"


def expected(kind: str, key: str) -> set[int] | None:
    """The statuses a call must get, or None: anything but 401 and 403."""
    if kind == "open" or key == "admin":
        return None
    if key == "none":
        return {401}
    return {403} if kind == "admin" else None


@pytest.mark.parametrize(("target", "method", "path"), ROUTES,
                         ids=[f"{t}-{m}-{p}" for t, m, p in ROUTES])
def test_every_route_asks_for_the_right_key(keyed: Targets, target: str, method: str,
                                            path: str) -> None:
    base = keyed.urls[target]
    params = dict(PATH_PARAMS, instance_id=_instance_id(keyed))
    url = base + path.format(**params)
    kind = kind_of(path)
    for key_name, key in KEYS.items():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.request(method, url, json=BODIES.get(path), headers=headers,
                                 timeout=15)
        assert response.status_code < 500, (key_name, response.status_code, response.text)
        want = expected(kind, key_name)
        if want is None:
            assert response.status_code not in (401, 403), (key_name, response.text)
        else:
            assert response.status_code in want, (key_name, response.text)
            assert response.json()["error"]["code"] in ("invalid_api_key",
                                                        "insufficient_permissions")


def test_the_route_tables_have_admin_client_and_open_routes() -> None:
    kinds = {kind_of(path) for _, _, path in ROUTES}
    assert kinds == {"open", "admin", "client"}
    assert ("instance", "POST", "/admin/drain") in ROUTES
    assert ("gateway", "POST", "/admin/releases") in ROUTES


_ids: dict[str, str] = {}


def _instance_id(keyed: Targets) -> str:
    if "id" not in _ids:
        listed = httpx.get(keyed.gateway.url + "/admin/instances", timeout=10,
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        _ids["id"] = listed["instances"][0]["instance_id"]
    return _ids["id"]
