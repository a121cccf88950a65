"""The exception tree is drawn in strata/errors.py's docstring and defined there only; every
error body (instance server, gateway, API-key auth) comes from strata.protocol.errors."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import strata.errors as errors
from strata.errors import (
    ContextLengthError,
    KVStoreUnavailableError,
    OverloadedError,
    SessionConflictError,
    SessionNotFoundError,
    StrataError,
)
from strata.gateway.upstream.pools import error_response as gateway_error_response
from strata.protocol.errors import describe, error_payload
from strata.server.errors import error_response as server_error_response

STRATA = Path(errors.__file__).parent


def _drawn_tree() -> list[tuple[int, str]]:
    """(depth, class name) for every line of the docstring's tree, in order."""
    rows = []
    for line in (errors.__doc__ or "").splitlines():
        words = line.lstrip(" │├└─").split()
        if not words or not words[0].endswith("Error"):
            continue
        prefix = line[: len(line) - len(line.lstrip(" │├└─"))]
        name = words[0]
        rows.append(((len(prefix) - 4) // 4, name))
    return rows


def _real_tree(cls: type, depth: int = 0) -> list[tuple[int, str]]:
    rows = [(depth, cls.__name__)]
    for sub in cls.__subclasses__():
        if sub.__module__ == "strata.errors":
            rows.extend(_real_tree(sub, depth + 1))
    return rows


def test_the_drawn_tree_is_the_class_tree() -> None:
    assert _drawn_tree() == _real_tree(StrataError)
    assert sorted(errors.__all__) == sorted(name for _, name in _real_tree(StrataError))


def test_no_exception_class_is_defined_outside_errors_py() -> None:
    found = []
    for path in STRATA.rglob("*.py"):
        if path.name == "errors.py" and path.parent == STRATA:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception"))
                                                 or b.id == "Superseded")
                    for b in node.bases):
                found.append(f"{path.relative_to(STRATA)}:{node.lineno} {node.name}")
    assert found == []


def test_each_error_says_how_it_is_answered() -> None:
    assert describe(ContextLengthError("too long", param="messages")).payload() == {
        "error": {"message": "too long", "type": "invalid_request_error", "param": "messages",
                  "code": "context_length_exceeded"}}
    conflict = describe(SessionConflictError("s", expected_revision=1, actual_revision=2))
    assert (conflict.status_code, conflict.type) == (409, "session_conflict")
    missing = describe(SessionNotFoundError("s"))
    assert (missing.status_code, missing.type) == (404, "not_found_error")
    down = describe(KVStoreUnavailableError("redis kv store: refused"))
    assert (down.status_code, down.headers) == (503, {"Retry-After": "1"})
    full = describe(OverloadedError("queue full", retry_after_s=2.5))
    assert (full.status_code, full.type, full.headers) == (429, "overloaded_error",
                                                           {"Retry-After": "3"})


def test_server_and_gateway_build_the_same_body() -> None:
    server = server_error_response(ContextLengthError("too long"))
    gateway = gateway_error_response(400, "too long", kind="invalid_request_error")
    assert json.loads(bytes(server.body))["error"].keys() == error_payload(400, "x")["error"].keys()
    assert json.loads(bytes(gateway.body)) == error_payload(400, "too long")
    assert json.loads(bytes(server.body))["error"]["code"] == "context_length_exceeded"
    assert json.loads(bytes(gateway.body))["error"]["code"] is None  # never the HTTP status
