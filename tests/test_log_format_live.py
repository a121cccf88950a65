"""`--log-format json` on real processes: a simulated `strata serve` behind a `strata gateway`.
Every line either process writes (stdout and stderr, uvicorn's lines and the access log
included) is one JSON object, and a request's X-Request-Id, the client's or the gateway's own,
is on the access-log lines of both."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness.procs import Proc, spawn, stop_all

JSON_FLAGS = ["--port", "0", "--log-format", "json", "--log-level", "debug"]


def _start(name: str, args: list[str], logs: Path, ready: str) -> Proc:
    proc = spawn(name, [sys.executable, "-m", "strata.cli", *args, *JSON_FLAGS], logs)
    proc.url = proc.wait_for_output(ready, timeout_s=120).group(1)
    return proc


@pytest.fixture
def stack(tmp_path: Path) -> Any:
    procs: list[Proc] = []
    try:
        procs.append(_start("serve", ["serve", "--simulate", "smollm2-cpu"], tmp_path,
                            r"Strata serving \S+ on (http://127\.0\.0\.1:\d+)"))
        procs.append(_start("gateway", ["gateway", "--instances", procs[0].url], tmp_path,
                            r"Strata gateway on (http://127\.0\.0\.1:\d+)"))
        yield procs
    finally:
        stop_all(procs)


def _records(proc: Proc) -> list[dict[str, Any]]:
    records = []
    for line in proc.output().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{proc.name} wrote a line that is not JSON: {line!r}")
    return records


def _access_ids(records: list[dict[str, Any]], path: str) -> list[str]:
    return [r.get("request_id", "") for r in records
            if r["logger"] == "uvicorn.access" and f"POST {path} " in r["message"]]


def test_every_line_is_json_and_the_request_id_reaches_the_instance(stack: list[Proc]) -> None:
    serve, gateway = stack
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4}
    url = f"{gateway.url}/v1/chat/completions"
    given = httpx.post(url, json=body, headers={"X-Request-Id": "client-req-1"}, timeout=30)
    made = httpx.post(url, json={**body, "stream": True}, timeout=30)
    assert given.status_code == made.status_code == 200
    assert given.headers["x-request-id"] == "client-req-1"
    made_id = made.headers["x-request-id"]
    assert made_id != "client-req-1" and len(made_id) == 32
    assert [p.stop() for p in (gateway, serve)] == [0, 0]  # SIGTERM: both drain and exit 0

    for proc in stack:
        records = _records(proc)
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
        assert _access_ids(records, "/v1/chat/completions") == ["client-req-1", made_id]
        assert any(r["message"].startswith("Started server process") for r in records)
    ready = [r for r in _records(serve) if r["message"].startswith("Strata serving")]
    assert len(ready) == 1 and "request_id" not in ready[0]
