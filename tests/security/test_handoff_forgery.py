"""A decode instance follows only hand-off handles its own fleet wrote (strata/server/pd/trust.py):
a handle the gateway sealed with the internal key, or one naming an instance the registry lists.
A forged one is a 400, and nothing is contacted: a local HTTP listener stands where a forged
handle points and must receive nothing. The same handle, sealed by the fleet, does reach it, with
the internal key (so the listener would have seen a forgery's request)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sim_stack import INTERNAL_KEY, MODEL, Targets

from strata.protocol.pd import DECODE_PREFIX, HANDOFF_HEADER, PREFILL_PREFIX
from strata.protocol.seal import is_sealed, seal

FLEET = {"Authorization": f"Bearer {INTERNAL_KEY}"}
CHAT = {"model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}]}


class Listener:
    """An HTTP server on a free loopback port that records every request it gets."""

    def __init__(self) -> None:
        seen = self.seen = list[tuple[str, str | None]]()

        class Record(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                seen.append((self.path, self.headers.get("authorization")))
                self.send_response(404)
                self.end_headers()

            do_DELETE = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Listener:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def listener() -> Iterator[Listener]:
    with Listener() as running:
        yield running


def genuine_handle(keyed: Targets) -> dict[str, Any]:
    """What the instance's prefill route answers for CHAT (the gateway's first call)."""
    answer = httpx.post(f"{keyed.instance.url}{PREFILL_PREFIX}/v1/chat/completions", json=CHAT,
                        headers=FLEET, timeout=30)
    assert answer.status_code == 200, answer.text
    handle: dict[str, Any] = answer.json()
    return handle


def decode(keyed: Targets, handle: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{keyed.instance.url}{DECODE_PREFIX}/v1/chat/completions", json=CHAT,
                      headers=FLEET | {HANDOFF_HEADER: json.dumps(handle)}, timeout=30)


def forgeries(handle: dict[str, Any], url: str) -> dict[str, dict[str, Any]]:
    pointed = handle | {"url": url, "instance_id": "p-0"}
    sealed = seal(pointed, INTERNAL_KEY)
    return {
        "unsealed": pointed,
        "sealed with another key": seal(pointed, "a-guessed-key"),
        "url changed after sealing": seal(handle | {"url": "http://127.0.0.1:1"},
                                          INTERNAL_KEY) | {"url": url},
        "token changed after sealing": sealed | {"token_id": sealed["token_id"] + 1},
        "a field added after sealing": sealed | {"extra": 1},
        "seal of the wrong type": pointed | {"seal": 7},
    }


def test_a_forged_handle_is_a_400_and_contacts_nothing(keyed: Targets,
                                                       listener: Listener) -> None:
    handle = genuine_handle(keyed)
    for name, forged in forgeries(handle, listener.url).items():
        answer = decode(keyed, forged)
        assert answer.status_code == 400, (name, answer.text)
        assert "not sealed with this fleet's internal key" in answer.json()["error"]["message"]
    assert listener.seen == []


def test_the_same_handle_sealed_by_the_fleet_is_followed(keyed: Targets,
                                                         listener: Listener) -> None:
    handle = genuine_handle(keyed)
    sealed = seal(handle | {"url": listener.url, "instance_id": "p-0"}, INTERNAL_KEY)
    answer = decode(keyed, sealed)
    assert answer.status_code == 200, answer.text  # P "failed": D prefilled itself
    assert listener.seen and listener.seen[0] == ("/internal/kv/layout", f"Bearer {INTERNAL_KEY}")


def test_the_seal_covers_every_field() -> None:
    fields = {"handle": "h", "num_blocks": 3, "logprob": -0.5, "top_logprobs": [[7, -0.5]],
              "url": "http://p:8000", "instance_id": "p-0"}
    sealed = seal(fields, "k")
    assert is_sealed(sealed, ["k"]) and is_sealed(json.loads(json.dumps(sealed)), ["old", "k"])
    for name in fields:
        assert not is_sealed(sealed | {name: "changed"}, ["k"]), name
    assert not is_sealed({k: v for k, v in sealed.items() if k != "url"}, ["k"])
    assert not is_sealed(sealed, ["other"])
