"""The session routes: GET /v1/sessions, GET and DELETE /v1/sessions/{id}.

Each answers for the caller's tenant only (see sessions.py): another tenant's session is a 404
exactly like an unknown one, so a key cannot even learn that an id is in use.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from strata.errors import InvalidRequestError, SessionNotFoundError
from strata.server.instance import instance_of
from strata.server.sessions import tenant_of
from strata.state.sessions import SessionRecord

T = TypeVar("T")


def record_json(record: SessionRecord, *, with_messages: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"id": record.session_id, "object": "session",
                            "revision": record.revision, "model": record.model,
                            "version": record.version, "created_at": record.created_at,
                            "updated_at": record.updated_at,
                            "num_messages": len(record.messages)}
    if with_messages:
        body["messages"] = list(record.messages)
    return body


async def list_sessions(request: Request, limit: int = 100) -> dict[str, Any]:
    sessions = instance_of(request).require_sessions()
    if not 1 <= limit <= 1000:
        raise InvalidRequestError("limit must be in 1..1000", param="limit")
    tenant = tenant_of(request)
    records = await sessions.store.list(tenant=tenant, limit=limit)
    return {"object": "list", "data": [record_json(r, with_messages=False) for r in records]}


async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    sessions = instance_of(request).require_sessions()
    tenant = tenant_of(request)
    record = await sessions.store.get(session_id, tenant=tenant)
    if record is None:
        raise SessionNotFoundError(session_id)
    return record_json(record)


async def delete_session(request: Request, session_id: str) -> Response:
    sessions = instance_of(request).require_sessions()
    tenant = tenant_of(request)
    if not await sessions.store.delete(session_id, tenant=tenant):
        raise SessionNotFoundError(session_id)
    return Response(status_code=204)


def session_routes() -> list[APIRoute]:
    return [
        APIRoute("/v1/sessions", list_sessions, methods=["GET"]),
        APIRoute("/v1/sessions/{session_id}", get_session, methods=["GET"]),
        APIRoute("/v1/sessions/{session_id}", delete_session, methods=["DELETE"]),
    ]


__all__ = ["record_json", "session_routes"]
