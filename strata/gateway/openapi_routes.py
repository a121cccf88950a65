"""The gateway's OpenAPI document (GET /openapi.json): the OpenAI operations it proxies
(strata/protocol/openapi.py) and its own admin API and dashboard."""

from __future__ import annotations

import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata.protocol.auth import AccessTable
from strata.protocol.openapi import OPENAI_OPERATIONS, Operation, openapi_document

GATEWAY_OPERATIONS: tuple[Operation, ...] = (
    *OPENAI_OPERATIONS,
    Operation("GET", "/openapi.json", "This document"),
    Operation("GET", "/admin/instances", "The gateway's view of each instance", access="admin"),
    Operation("POST", "/admin/instances/{instance_id}/drain", "Stop routing there and drain it",
              status=202, access="admin"),
    Operation("GET", "/admin/consistency", "Each state's consistency level, staleness bound "
              "and failure cost, as this gateway is configured", access="admin"),
    Operation("GET", "/admin/usage", "Each tenant's requests, errors and tokens per model "
              "since a time, summed over the gateways sharing the usage store", access="admin",
              query=(("since", "string"), ("tenant", "string"))),
    Operation("GET", "/admin/models", "Models: routing, versions, instances", access="admin"),
    Operation("POST", "/admin/models", "Register name@version -> URI", status=201,
              access="admin"),
    Operation("POST", "/admin/models/{name}/rollback", "Roll back a model", status=202,
              access="admin"),
    Operation("GET", "/admin/releases", "Releases, oldest first", access="admin",
              query=(("model", "string"),)),
    Operation("POST", "/admin/releases", "Start a release", status=202, access="admin"),
    Operation("GET", "/admin/releases/{release_id}", "One release", access="admin"),
    Operation("GET", "/dashboard", "The live dashboard page", access="open",
              media_type="text/html"),
    Operation("GET", "/dashboard/data", "The dashboard's JSON snapshot (instance URLs, model "
              "URIs and errors for the admin key only)"),
    Operation("GET", "/dashboard/static/{name}", "The dashboard's script, styles and icon",
              access="open", media_type="text/javascript"),
)


def gateway_access() -> AccessTable:
    """Who may call each route of the gateway: its documented access."""
    return AccessTable.of_operations(GATEWAY_OPERATIONS)


@functools.cache
def gateway_openapi() -> dict[str, Any]:
    """The gateway's OpenAPI document, built once, at its first GET (not at every start)."""
    return openapi_document("Strata gateway", GATEWAY_OPERATIONS)


def openapi_route() -> Route:
    async def openapi(request: Request) -> Response:
        return JSONResponse(gateway_openapi())

    return Route("/openapi.json", openapi, methods=["GET"])


__all__ = ["GATEWAY_OPERATIONS", "gateway_access", "openapi_route"]
