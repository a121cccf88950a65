"""GET /admin/consistency over a real socket: each state's row follows the gateway's own flags
(a shared pin store instead of its memory, the poll interval, the response cache's TTL), and
only the admin key reads it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_fleet import serve_gateway


def rows_of(tmp_path: Path, *flags: str) -> Iterator[tuple[str, dict[str, Any]]]:
    (tmp_path / "client.keys").write_text("client-key\n")
    (tmp_path / "admin.keys").write_text("admin-key\n")
    served = serve_gateway(["--instances", "http://127.0.0.1:9",
                            "--api-key-file", str(tmp_path / "client.keys"),
                            "--admin-key-file", str(tmp_path / "admin.keys"), *flags])
    try:
        url = f"{served.url}/admin/consistency"
        assert httpx.get(url, headers={"Authorization": "Bearer client-key"}).status_code in (
            401, 403)
        answer = httpx.get(url, headers={"Authorization": "Bearer admin-key"})
        assert answer.status_code == 200, answer.text
        yield from ((row["state"], row) for row in answer.json()["states"])
    finally:
        served.stop()


def test_the_defaults_keep_pins_in_this_gateway_and_caches_off(tmp_path: Path) -> None:
    rows = dict(rows_of(tmp_path))
    assert set(rows) == {"session_history", "session_pins", "version_pins",
                         "model_routing_and_releases", "instance_registry", "prefix_index",
                         "response_cache", "kv_store", "pd_leases", "tenant_usage_and_budgets"}
    assert rows["session_pins"]["level"] == "off"
    assert rows["version_pins"]["store"] == "memory of this gateway"
    assert rows["version_pins"]["level"] == "this gateway only"
    assert rows["response_cache"]["level"] == "off"
    assert rows["tenant_usage_and_budgets"]["level"] == "this gateway only"
    assert rows["model_routing_and_releases"]["staleness_bound_s"] == pytest.approx(0.2)


def test_each_row_follows_the_flags(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'pins.db'}"
    rows = dict(rows_of(tmp_path, "--session-routing", "sticky", "--session-store", store,
                        "--routing-poll-s", "0.5", "--response-cache",
                        f"sqlite:///{tmp_path / 'answers.db'}", "--response-cache-ttl-s", "42",
                        "--policy", "cache_aware", "--usage-store", "redis://127.0.0.1:1/0"))
    pins = rows["session_pins"]
    assert pins["store"] == "SQLite (shared on this machine)"
    assert pins["level"].startswith("eventual across gateways")
    assert pins["staleness_bound_s"] == pytest.approx(1.0)  # --session-local-pin-age-s
    assert rows["version_pins"]["level"].startswith("strong per session")  # the shared store
    assert rows["model_routing_and_releases"]["staleness_bound_s"] == pytest.approx(0.5)
    assert rows["response_cache"]["staleness_bound_s"] == pytest.approx(42.0)
    assert rows["prefix_index"]["level"].startswith("eventual")
    usage = rows["tenant_usage_and_budgets"]
    assert (usage["store"], usage["level"][:6]) == ("Redis (shared)", "atomic")
