"""What a client key cannot do through the keyed gateway and instance (real processes): choose a
pool, claim another tenant's identity, or reach a fleet-only route through the gateway; and what
the gateway sends on (the internal key, never the client's, and the client's identity beside
it), seen by a listener standing where an instance would be."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.procs import spawn
from sim_stack import ADMIN_KEY, CLIENT_KEY, INTERNAL_KEY, MODEL, OTHER_CLIENT_KEY, Targets

from strata.protocol.keys import MAX_PRIORITY_HEADER, TENANT_HEADER, tenant_of_key
from strata.protocol.pd import HANDOFF_HEADER

CHAT = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_pool_header_from_a_client_is_refused_and_the_operators_is_honoured(
        keyed: Targets) -> None:
    url = f"{keyed.gateway.url}/v1/chat/completions"
    for key in (CLIENT_KEY, OTHER_CLIENT_KEY):
        refused = httpx.post(url, json=CHAT, headers=auth(key) | {"X-Strata-Pool": "default"},
                             timeout=15)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "permission_error"
        assert "x-strata-pool" in refused.json()["error"]["message"]
    for key in (ADMIN_KEY, INTERNAL_KEY):
        honoured = httpx.post(url, json=CHAT, headers=auth(key) | {"X-Strata-Pool": "default"},
                              timeout=15)
        assert honoured.status_code == 200, honoured.text
        elsewhere = httpx.post(url, json=CHAT, timeout=15,
                               headers=auth(key) | {"X-Strata-Pool": "no-such-pool"})
        assert elsewhere.status_code == 503, elsewhere.text  # the pool has no instance
    assert httpx.post(url, json=CHAT, headers=auth(CLIENT_KEY), timeout=15).status_code == 200


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_a_client_cannot_claim_another_tenants_identity(keyed: Targets, target: str) -> None:
    """A client that sends the identity headers the gateway forwards gets its own tenant: its
    session is not the other tenant's, nor is its ceiling lifted."""
    base, session = keyed.urls[target], f"claimed-{target}"
    first = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=15,
                       headers=auth(OTHER_CLIENT_KEY) | {"X-Session-Id": session})
    assert first.status_code == 200, first.text
    claim = {TENANT_HEADER: tenant_of_key(OTHER_CLIENT_KEY), MAX_PRIORITY_HEADER: "1000"}
    read = httpx.get(f"{base}/v1/sessions/{session}", headers=auth(CLIENT_KEY) | claim,
                     timeout=15)
    assert read.status_code == 404  # exactly as for a session nobody has
    theirs = httpx.get(f"{base}/v1/sessions/{session}", headers=auth(OTHER_CLIENT_KEY),
                       timeout=15)
    assert theirs.status_code == 200 and theirs.json()["num_messages"] == 2


def test_the_gateway_does_not_open_a_fleet_route_to_a_client(keyed: Targets) -> None:
    """The gateway proxies the OpenAI API only: a fleet path through it is no route."""
    for path in ("/internal/prefill/v1/chat/completions", "/v1/strata/resume"):
        answer = httpx.post(keyed.gateway.url + path, json=CHAT, headers=auth(CLIENT_KEY),
                            timeout=15)
        assert answer.status_code in (403, 404), (path, answer.text)


class Recorder:
    """An HTTP server standing where an instance would be: answers a chat completion and
    records the headers of every request."""

    def __init__(self) -> None:
        seen = self.seen = list[dict[str, str]]()

        class Answer(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                seen.append({k.lower(): v for k, v in self.headers.items()})
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._json({"id": "c", "object": "chat.completion", "created": 1,
                            "model": MODEL, "choices": [], "usage": None})

            def do_GET(self) -> None:  # noqa: N802
                self._json({"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                           if self.path == "/v1/models" else {"status": "ok"})

            def _json(self, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def recorded_gateway(tmp_path: Path) -> Iterator[tuple[str, Recorder]]:
    """A keyed `strata gateway` over the recorder."""
    recorder = Recorder()
    (tmp_path / "keys").write_text(f"{CLIENT_KEY}:batch\n")
    (tmp_path / "admin").write_text(f"{ADMIN_KEY}\n")
    (tmp_path / "internal").write_text(f"{INTERNAL_KEY}\n")
    argv = [sys.executable, "-m", "strata.cli", "gateway", "--instances", recorder.url,
            "--port", "0", "--api-key-file", str(tmp_path / "keys"), "--admin-key-file",
            str(tmp_path / "admin"), "--internal-key-file", str(tmp_path / "internal")]
    gateway = spawn("gateway", argv, tmp_path / "logs")
    try:
        url = gateway.wait_for_output(r"Strata gateway on (http://127\.0\.0\.1:\d+) ", 60)
        yield url.group(1), recorder
    finally:
        gateway.kill()
        recorder.close()


def test_the_gateway_sends_its_internal_key_and_the_clients_identity_never_its_key(
        recorded_gateway: tuple[str, Recorder]) -> None:
    url, recorder = recorded_gateway
    forged = {TENANT_HEADER: "f" * 32, MAX_PRIORITY_HEADER: "1000",
              HANDOFF_HEADER: '{"url": "http://elsewhere"}'}
    answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=15,
                        headers=auth(CLIENT_KEY) | forged)
    assert answer.status_code == 200, answer.text
    [sent] = recorder.seen
    assert sent["authorization"] == f"Bearer {INTERNAL_KEY}"
    assert sent[TENANT_HEADER] == tenant_of_key(CLIENT_KEY)
    assert sent[MAX_PRIORITY_HEADER] == "-10"  # the key's ceiling: batch
    assert HANDOFF_HEADER not in sent
    assert CLIENT_KEY not in json.dumps(sent)
