"""The live dashboard: what this gateway sees, in a browser, refreshed every second.

    GET /dashboard                the page (static HTML; its script polls the data endpoint)
    GET /dashboard/data           the JSON snapshot (strata/gateway/control/dashboard/data.py) and
                                  `access`: {"admin": may this caller use the buttons,
                                  "keyed": does the gateway check keys at all}; it takes a
                                  key like the OpenAI API, and shows the fleet's insides
                                  (instance URLs, model URIs, error texts, every tenant's
                                  usage, the slowest requests) to the admin only; a client
                                  key sees its own usage
    GET /dashboard/static/NAME    the page's script and styles, and uPlot 1.6.32 (MIT, taken
                                  from the npm registry; LICENSE beside it), all package data

Everything the page uses comes from this process: it loads nothing from another origin, and
its Content-Security-Policy forbids it to. The page and its files need no key; the data does
(the page asks for one). Its buttons (drain, release, rollback) call the admin API
(strata/gateway/routes.py, admin.py) with the key typed into the page, which that API checks
like any other call: the page never grants more than the API does. `is_admin` is the one place
that decides whom the page offers the buttons and the fleet's insides to.

Cost: one more proxy observer (an O(1) update of the current second's slot per attempt); the
instances' counters are read only while a dashboard polls (dashboard_scrape.py).
"""

from __future__ import annotations

import hashlib
import time
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata.clock import Clock
from strata.gateway.control.dashboard.data import AutoscalerSource, DashboardData
from strata.gateway.control.dashboard.scrape import CounterReader
from strata.gateway.control.dashboard.series import LiveSeries
from strata.gateway.upstream.pools import error_response
from strata.gateway.wiring import Gateway
from strata.protocol.auth import is_open
from strata.protocol.keys import Keys, Kind, caller_of

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
# served without a key (their OpenAPI rows say `open`); the data takes one
DASHBOARD_PATHS = frozenset({PAGE, *(f"{STATIC}/{name}" for name in ASSETS)})
HIDDEN = "hidden: the admin key shows it"


def is_admin(request: Request) -> bool:
    """Whether the page offers this caller its buttons and the fleet's insides: when the
    request carries what the admin API takes (strata/protocol/auth.py): the admin key, or
    anything while the admin API is open (a gateway without keys)."""
    config = _gateway(request).config
    keys = Keys(config.api_keys, config.admin_keys, config.internal_keys)
    return caller_of(request.scope).kind is Kind.ADMIN or is_open("admin", keys)


def for_viewer(data: dict[str, Any], *, is_admin: bool,
               tenant: str | None = None) -> dict[str, Any]:
    """The snapshot as this viewer sees it: without the admin key, no instance URL, model URI
    or error text (they name the fleet's insides: hosts, buckets, stores), an instance whose
    id is its address (a static one) under an alias, of the tenants only the caller's own
    (`tenant`: its client key's; none without one), and no slowest requests (their ids are
    other tenants')."""
    if is_admin:
        return data
    alias = {row["instance_id"]: _alias(row) for row in data["instances"]}
    instances = [row | {"url": HIDDEN, "instance_id": alias[row["instance_id"]]}
                 for row in data["instances"]]
    models = [model | {"versions": [v | {"uri": HIDDEN if v.get("uri") else v.get("uri")}
                                    for v in model["versions"]]} for model in data["models"]]
    errors = [f"{len(data['errors'])} part(s) could not be read ({HIDDEN})"] \
        if data["errors"] else []
    sessions = dict(data["sessions"])
    if sessions.get("pinned"):
        sessions["pinned"] = {alias.get(iid, iid): n for iid, n in sessions["pinned"].items()}
    tenants = data.get("tenants")
    if tenants is not None:
        tenants = tenants | {"rows": [row for row in tenants["rows"]
                                      if tenant is not None and row["tenant"] == tenant]}
    return data | {"instances": instances, "models": models, "errors": errors,
                   "sessions": sessions, "tenants": tenants, "slow_requests": []}


def _alias(row: dict[str, Any]) -> str:
    instance_id = str(row["instance_id"])
    if instance_id != urlsplit(str(row["url"])).netloc:
        return instance_id
    return "instance-" + hashlib.sha256(instance_id.encode()).hexdigest()[:8]


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
        admin = is_admin(request)
        body = for_viewer(await data.snapshot(), is_admin=admin,
                          tenant=caller_of(request.scope).tenant)
        config = gateway.config
        keyed = bool(config.api_keys or config.admin_keys or config.internal_keys)
        return JSONResponse(body | {"access": {"admin": admin, "keyed": keyed}},
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


__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "DASHBOARD_PATHS", "HIDDEN", "dashboard_routes",
           "for_viewer", "is_admin"]
