"""The hand-off and resume routes take a client's request through the instance's one door, as the
plain routes do: two API keys on one real instance (tiny model, float32), every route's engine
request in its tenant's cache namespace and at its key's clamped priority, and one tenant's
blocks never serving the other's prompt. The fleet's routes take only the internal key: a call
to them carries the client's identity as the gateway forwards it (strata/protocol/keys.py).

Routes: POST /v1/completions (the reference), /internal/prefill/v1/completions,
/internal/decode/v1/completions (no handle: the decode instance prefills locally) and
/v1/strata/resume."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from live_server import MODEL_NAME, LiveServer, start_server

from strata.engine.request import Request as EngineRequest
from strata.model.loader import LoadedModel
from strata.protocol.keys import Caller, Kind, forwarded_identity, tenant_of_key
from strata.protocol.pd import DECODE_PREFIX, PREFILL_PREFIX
from strata.protocol.resume import RESUME_PATH
from strata.types import PriorityClass

KEY_A, KEY_B = "k-tenant-a", "k-tenant-b"  # B's ceiling is batch
INTERNAL_KEY = "k-fleet"
CEILINGS = {KEY_B: int(PriorityClass.BATCH)}
PROMPT = " ".join(f"w{i}" for i in range(40))  # several full blocks of 8 tokens


@dataclass(frozen=True)
class Seen:
    cache_salt: str | None
    priority: int


@pytest.fixture()
def server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    served = start_server(tiny_model, api_keys=(KEY_A, KEY_B),
                          key_max_priority=tuple(CEILINGS.items()),
                          internal_keys=(INTERNAL_KEY,))
    yield served
    served.stop()


@pytest.fixture()
def seen(server: LiveServer) -> list[Seen]:
    """Every request the engine is given, as the engine sees it (a spy on `add_request`)."""
    requests: list[Seen] = []
    add_request = server.engine.add_request

    def spy(request: EngineRequest) -> None:
        requests.append(Seen(request.cache_salt, request.priority))
        add_request(request)

    server.engine.add_request = spy  # type: ignore[method-assign]
    return requests


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "priority": "interactive", **extra}


def as_sent(path: str, key: str) -> dict[str, str]:
    """The headers of a call for the client of `key`: its key on a plain route; on the fleet's,
    the internal key and the client's identity, as the gateway forwards them."""
    if not path.startswith(("/internal/", "/v1/strata/")):
        return {"authorization": f"Bearer {key}"}
    client = Caller(Kind.CLIENT, tenant_of_key(key), CEILINGS.get(key))
    return {"authorization": f"Bearer {INTERNAL_KEY}", **dict(forwarded_identity(client))}


def post(server: LiveServer, path: str, key: str, payload: dict[str, Any]) -> httpx.Response:
    answer = httpx.post(server.base_url + path, json=payload, timeout=60,
                        headers=as_sent(path, key))
    assert answer.status_code == 200, answer.text
    return answer


def resume_payload(server: LiveServer, key: str) -> dict[str, Any]:
    ids = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT},
                     headers={"authorization": f"Bearer {key}"}).json()["tokens"]
    return {"path": "/v1/completions", "request": body(stream=True), "id": "cmpl-resumed",
            "created": 1, "version": f"{MODEL_NAME}@default", "prompt_token_ids": ids,
            "output_token_ids": [ids[-1]]}


ROUTES = {
    "prefill": lambda server, key: post(server, f"{PREFILL_PREFIX}/v1/completions", key, body()),
    "decode": lambda server, key: post(server, f"{DECODE_PREFIX}/v1/completions", key, body()),
    "resume": lambda server, key: post(server, RESUME_PATH, key, resume_payload(server, key)),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_route_scopes_blocks_by_tenant_and_clamps_priority_as_the_plain_route_does(
        server: LiveServer, seen: list[Seen], route: str) -> None:
    post(server, "/v1/completions", KEY_A, body())
    post(server, "/v1/completions", KEY_B, body())
    plain_a, plain_b = seen
    assert plain_a.cache_salt != plain_b.cache_salt  # the reference: one namespace per tenant
    assert (plain_a.priority, plain_b.priority) == (PriorityClass.INTERACTIVE,
                                                    PriorityClass.BATCH)
    seen.clear()
    ROUTES[route](server, KEY_A)
    ROUTES[route](server, KEY_B)
    assert seen == [plain_a, plain_b]


def test_one_tenants_blocks_serve_its_own_hand_offs_and_never_the_other_tenants(
        server: LiveServer) -> None:
    post(server, "/v1/completions", KEY_A, body())  # A's blocks of PROMPT are cached
    handle_b = post(server, f"{PREFILL_PREFIX}/v1/completions", KEY_B, body()).json()
    assert handle_b["num_cached_tokens"] == 0  # A's blocks never serve B
    handle_a = post(server, f"{PREFILL_PREFIX}/v1/completions", KEY_A, body()).json()
    assert handle_a["num_cached_tokens"] > 0  # A's blocks serve A's hand-off
    hits = server.engine.stats().prefix_cache_hits
    decode_b = post(server, f"{DECODE_PREFIX}/v1/completions", KEY_B, body()).json()
    num_cached = decode_b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert server.engine.stats().prefix_cache_hits - hits == num_cached > 0  # B's own blocks
