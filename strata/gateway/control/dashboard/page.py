"""The live dashboard: what this gateway sees, in a browser, refreshed every second.

    GET /dashboard                the page (static HTML; its script polls the data endpoint)
    GET /dashboard/data           the JSON snapshot (strata/gateway/control/dashboard/data.py) and
                                  `access`: {"admin": may this caller use the buttons,
                                  "keyed": does the gateway check keys at all}
    GET /dashboard/static/NAME    the page's script and styles, and uPlot 1.6.32 (MIT, taken
                                  from the npm registry; LICENSE beside it), all package data

Everything the page uses comes from this process: it loads nothing from another origin, and
its Content-Security-Policy forbids it to. These paths need no API key, so without one the
dashboard is read-only. Its buttons (drain, release, rollback) call the admin API
(strata/gateway/routes.py, admin.py) with the key typed into the page, which that API checks
like any other call: the page never grants more than the API does. `is_admin` is the one place
that decides whom the page offers the buttons to.

Cost: one more proxy observer (an O(1) update of the current second's slot per attempt); the
instances' counters are read only while a dashboard polls (dashboard_scrape.py).
"""

from __future__ import annotations

import hmac
import time
from importlib import resources

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata.clock import Clock
from strata.gateway.control.dashboard.data import AutoscalerSource, DashboardData
from strata.gateway.control.dashboard.scrape import CounterReader
from strata.gateway.control.dashboard.series import LiveSeries
from strata.gateway.upstream.pools import error_response
from strata.gateway.wiring import Gateway
from strata.protocol.auth import bearer_key, match_key

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_HEADERS = {"content-security-policy": CONTENT_SECURITY_POLICY,
            "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}
ASSETS = {  # file in static/ -> media type
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
PAGE, DATA, STATIC = "/dashboard", "/dashboard/data", "/dashboard/static"
# served without an API key (the ApiKeyAuth middleware lets these through)
DASHBOARD_PATHS = frozenset({PAGE, DATA, *(f"{STATIC}/{name}" for name in ASSETS)})


def is_admin(request: Request) -> bool:
    """Whether the page offers this caller its buttons: when the request carries what the admin
    API takes (strata/protocol/auth.py): an admin key, or with no admin key set one of the
    client keys, or anything when the gateway has no key at all (its admin API is open)."""
    config = _gateway(request).config
    keys = config.admin_keys or config.api_keys
    if not keys:
        return True
    presented = bearer_key(request.headers.get("authorization", "")).encode()
    return match_key(presented, [key.encode() for key in keys], hmac.compare_digest) is not None


def dashboard_routes(gateway: Gateway, *, autoscaler: AutoscalerSource | None = None,
                     clock: Clock = time.time) -> list[Route]:
    """The dashboard's routes over `gateway`; hooks its series into the proxy's observers.
    `clock` is the wall clock the samples and heartbeat ages are read on."""
    series = LiveSeries(clock=clock)
    gateway.proxy.observers.append(series.observe)
    reader = CounterReader(gateway.control, series, clock=clock,
                           timeout_s=min(0.5, gateway.config.health_timeout_s))
    data = DashboardData(gateway, series, reader, autoscaler=autoscaler, clock=clock)
    files = {name: _read(name) for name in ("index.html", *ASSETS)}

    async def page(request: Request) -> Response:
        return Response(files["index.html"], media_type="text/html; charset=utf-8",
                        headers=_HEADERS | {"cache-control": "no-cache"})

    async def snapshot(request: Request) -> Response:
        body = await data.snapshot()
        keyed = bool(gateway.config.api_keys or gateway.config.admin_keys)
        access = {"admin": is_admin(request), "keyed": keyed}
        return JSONResponse(body | {"access": access},
                            headers=_HEADERS | {"cache-control": "no-store"})

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return error_response(404, f"no dashboard file {name!r}")
        return Response(files[name], media_type=ASSETS[name],
                        headers=_HEADERS | {"cache-control": "no-cache"})

    return [Route(PAGE, page, methods=["GET"]), Route(DATA, snapshot, methods=["GET"]),
            Route(STATIC + "/{name}", asset, methods=["GET"])]


def _read(name: str) -> bytes:
    return resources.files("strata.gateway.control.dashboard").joinpath("static", name).read_bytes()


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "DASHBOARD_PATHS", "dashboard_routes",
           "is_admin"]
