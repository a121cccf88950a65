"""The session routes: GET /v1/sessions, GET and DELETE /v1/sessions/{id}.

Each answers for the caller's tenant only (see sessions.py): another tenant's session is a 404
exactly like an unknown one, so a key cannot even learn that an id is in use.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response

from strata.errors import InvalidRequestError
from strata.server.sessions import (
    SessionNotFoundHTTPError,
    Sessions,
    store_errors,
    tenant_of,
)
from strata.state.sessions import (
    SessionNotFoundError,
    SessionRecord,
    SessionStoreUnavailableError,
)

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


def sessions_of(app: Any) -> Sessions:
    """The app's sessions, or a 400 that says how to turn them on."""
    found: Sessions | None = getattr(app.state, "sessions", None)
    if found is None:
        raise InvalidRequestError("this server keeps no sessions; start it with "
                                  "--session-store URL (memory://, sqlite:///PATH, redis://...)",
                                  param="session_id")
    return found


def install_session_routes(app: FastAPI) -> None:
    """GET /v1/sessions, GET and DELETE /v1/sessions/{id}, for the caller's tenant only."""

    @app.get("/v1/sessions")
    async def list_sessions(request: Request, limit: int = 100) -> dict[str, Any]:
        sessions = sessions_of(request.app)
        if not 1 <= limit <= 1000:
            raise InvalidRequestError("limit must be in 1..1000", param="limit")
        tenant = tenant_of(request, sessions.config)
        records = await _store_call(sessions.store.list(tenant=tenant, limit=limit))
        return {"object": "list", "data": [record_json(r, with_messages=False) for r in records]}

    @app.get("/v1/sessions/{session_id}")
    async def get_session(request: Request, session_id: str) -> dict[str, Any]:
        sessions = sessions_of(request.app)
        tenant = tenant_of(request, sessions.config)
        record = await _store_call(sessions.store.get(session_id, tenant=tenant))
        if record is None:
            raise SessionNotFoundHTTPError(str(SessionNotFoundError(session_id)))
        return record_json(record)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(request: Request, session_id: str) -> Response:
        sessions = sessions_of(request.app)
        tenant = tenant_of(request, sessions.config)
        if not await _store_call(sessions.store.delete(session_id, tenant=tenant)):
            raise SessionNotFoundHTTPError(str(SessionNotFoundError(session_id)))
        return Response(status_code=204)


async def _store_call(work: Awaitable[T]) -> T:
    try:
        return await work
    except SessionStoreUnavailableError as exc:
        raise store_errors(exc) from exc


__all__ = ["install_session_routes", "record_json", "sessions_of"]
