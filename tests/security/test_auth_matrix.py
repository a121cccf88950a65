"""Every operation of the instance's and the gateway's OpenAPI documents (every route, every
method: the fuzz suite holds each document to its app's route table), called on real keyed
processes with no key, a client key, another tenant's client key, the fleet's internal key and
the admin key. The document says which kinds of key an operation takes (its `security`); the
answer must agree:

    a key of a kind it takes (or any caller, for an open one)   anything but 401 and 403
    no key, or a key nobody issued                              401 invalid_api_key
    a key of a kind it does not take                            403 insufficient_permissions

and nothing is ever a 5xx. The drains go last (they stop the instance).
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import pooled_http as http
from sim_stack import ADMIN_KEY, CLIENT_KEY, INTERNAL_KEY, MODEL, OTHER_CLIENT_KEY, Targets

from strata.gateway.openapi_routes import GATEWAY_OPERATIONS
from strata.protocol.openapi import openapi_document
from strata.server.openapi_routes import INSTANCE_OPERATIONS

KEYS: dict[str, tuple[str | None, str | None]] = {  # name: (key, the kind it is)
    "none": (None, None), "unknown": ("a-key-nobody-issued", None),
    "client": (CLIENT_KEY, "client"), "other tenant": (OTHER_CLIENT_KEY, "client"),
    "internal": (INTERNAL_KEY, "internal"), "admin": (ADMIN_KEY, "admin"),
}
PATH_PARAMS = {"session_id": "no-such-session", "release_id": "r-0", "name": "dashboard.js",
               "handle": "no-such-handle"}
CHAT = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/internal/prefill/v1/chat/completions": CHAT,
    "/internal/decode/v1/chat/completions": CHAT,
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
DOCUMENTS = {"instance": ("Strata instance", INSTANCE_OPERATIONS),
             "gateway": ("Strata gateway", GATEWAY_OPERATIONS)}
# what only the fleet calls on an instance (the list): written out, not read from the
# table, so that a route the table forgot to close still fails here
FLEET_ONLY = [("POST", "/internal/prefill/v1/chat/completions"),
              ("POST", "/internal/prefill/v1/completions"),
              ("POST", "/internal/decode/v1/chat/completions"),
              ("POST", "/internal/decode/v1/completions"), ("GET", "/internal/kv/layout"),
              ("GET", "/internal/kv/{handle}"), ("DELETE", "/internal/kv/{handle}"),
              ("GET", "/internal/kv/{handle}/shm"),
              ("POST", "/v1/strata/resume"), ("GET", "/v1/strata/kv-events"),
              ("GET", "/v1/strata/tokenizer"), ("POST", "/admin/drain"),
              # LoRA adapters loaded at run time: the operator's admin key, or a gateway's
              # release controller with the internal key (registered adapter versions)
              ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]


def takes(document: dict[str, Any], method: str, path: str) -> frozenset[str]:
    """The kinds of key an operation takes as `document` says (its `security`; none: open)."""
    security = document["paths"][path][method.lower()].get("security", [])
    return frozenset(name for requirement in security for name in requirement)


def operations(target: str) -> list[tuple[str, str, str]]:
    _, ops = DOCUMENTS[target]
    return [(target, op.method, op.path) for op in ops]


def _last_if_drain(row: tuple[str, str, str]) -> tuple[bool, bool]:
    target, _, path = row
    return ("drain" in path, target == "instance")  # the instance's own drain the very last


ROWS = sorted(operations("instance") + operations("gateway"), key=_last_if_drain)


def expected(kinds: frozenset[str], key_kind: str | None) -> int | None:
    """The status the call must get, or None: anything but 401 and 403."""
    if not kinds or key_kind in kinds:
        return None
    return 401 if key_kind is None else 403


@pytest.fixture(scope="module")
def served_documents(keyed: Targets) -> dict[str, dict[str, Any]]:
    """The documents as the processes serve them (GET /openapi.json)."""
    auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
    return {target: http.get(f"{url}/openapi.json", headers=auth, timeout=10).json()
            for target, url in keyed.urls.items()}


def test_the_served_documents_are_the_tables(served_documents: dict[str, dict[str, Any]]
                                             ) -> None:
    for target, (title, ops) in DOCUMENTS.items():
        assert served_documents[target]["paths"] == openapi_document(title, ops)["paths"]


@pytest.mark.parametrize(("target", "method", "path"), ROWS,
                         ids=[f"{t}-{m}-{p}" for t, m, p in ROWS])
def test_every_operation_answers_each_key_as_documented(
        keyed: Targets, served_documents: dict[str, dict[str, Any]], target: str, method: str,
        path: str) -> None:
    kinds = takes(served_documents[target], method, path)
    url = keyed.urls[target] + path.format(**PATH_PARAMS, instance_id=_instance_id(keyed))
    for key_name, (key, key_kind) in KEYS.items():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = http.request(method, url, json=BODIES.get(path), headers=headers,
                                 timeout=15)
        assert response.status_code < 500, (key_name, response.status_code, response.text)
        want = expected(kinds, key_kind)
        if want is None:
            assert response.status_code not in (401, 403), (key_name, response.text)
        else:
            assert response.status_code == want, (key_name, response.text)
            code = "invalid_api_key" if want == 401 else "insufficient_permissions"
            assert response.json()["error"]["code"] == code


def test_the_documents_have_every_kind_of_route() -> None:
    documents = {t: openapi_document(title, ops) for t, (title, ops) in DOCUMENTS.items()}
    found = {(target, method, path): takes(documents[target], method, path)
             for target, method, path in ROWS}
    assert found[("instance", "POST", "/internal/decode/v1/chat/completions")] == {"internal"}
    assert found[("instance", "POST", "/v1/strata/resume")] == {"internal"}
    assert found[("instance", "GET", "/v1/strata/kv-events")] == {"internal"}
    assert found[("instance", "POST", "/admin/drain")] == {"admin", "internal"}
    # the operator's, and a gateway's release controller's (registered adapter versions)
    assert found[("instance", "POST", "/v1/load_lora_adapter")] == {"admin", "internal"}
    assert found[("instance", "POST", "/v1/unload_lora_adapter")] == {"admin", "internal"}
    assert found[("instance", "POST", "/v1/chat/completions")] == {"client", "admin", "internal"}
    assert found[("instance", "GET", "/health")] == frozenset()
    assert found[("gateway", "POST", "/admin/models")] == {"admin"}
    assert found[("gateway", "GET", "/dashboard/data")] == {"client", "admin", "internal"}
    assert found[("gateway", "GET", "/dashboard")] == frozenset()
    for target, method, path in ROWS:
        if path.startswith("/internal/"):
            assert found[(target, method, path)] == {"internal"}, path


def test_a_client_key_opens_no_fleet_route(keyed: Targets) -> None:
    """The story the matrix generalises: a client's key (either tenant's) on each fleet-only
    route of an instance is refused before the route runs (no blocks held, no handle given, no
    drain), and the table documents each of them as the fleet's."""
    for method, path in FLEET_ONLY:
        for key in (CLIENT_KEY, OTHER_CLIENT_KEY):
            answer = http.request(method, keyed.instance.url + path.format(**PATH_PARAMS),
                                   json=BODIES.get(path), timeout=15,
                                   headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 403, (method, path, answer.text)
            assert "internal" in answer.json()["error"]["message"]
    documented = {(op.method, op.path) for op in INSTANCE_OPERATIONS
                  if op.access in ("internal", "fleet")}
    assert documented == set(FLEET_ONLY)


def test_no_instance_route_is_the_operators_alone() -> None:
    """Every admin route of an instance also takes the fleet's key (a gateway drives them)."""
    assert not [(op.method, op.path) for op in INSTANCE_OPERATIONS if op.access == "admin"]


_ids: dict[str, str] = {}


def _instance_id(keyed: Targets) -> str:
    if "id" not in _ids:
        listed = http.get(keyed.gateway.url + "/admin/instances", timeout=10,
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        _ids["id"] = listed["instances"][0]["instance_id"]
    return _ids["id"]
