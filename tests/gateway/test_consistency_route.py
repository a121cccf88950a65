"""GET /admin/consistency over a real socket: each state's row follows the gateway's own flags
(a shared pin store instead of its memory, the poll interval, the response cache's TTL), and
only the admin key reads it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_fleet import gateway_config, serve_gateway

from strata.cli import build_parser
from strata.commands import up
from strata.commands.env import CliEnv
from strata.errors import ConfigError


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


def test_strict_release_consistency_has_its_own_row_and_a_lease_of_two_polls(
        tmp_path: Path) -> None:
    rows = dict(rows_of(tmp_path, "--release-consistency", "strict", "--routing-lease-s", "3"))
    routing = rows["model_routing_and_releases"]
    assert routing["level"].startswith("strict: a release's flip completes only once")
    assert routing["staleness_bound_s"] == 0.0  # relative to the flip's completion
    assert "refuses routed requests 3 s after" in routing["after_failure"]
    bounded = dict(rows_of(tmp_path))["model_routing_and_releases"]
    assert bounded["level"].startswith("bounded")
    with pytest.raises(ConfigError, match="at least twice --routing-poll-s"):
        gateway_config(["--instances", "http://127.0.0.1:9", "--release-consistency", "strict",
                        "--routing-poll-s", "0.5", "--routing-lease-s", "0.9"])
    gateway_config(["--instances", "http://127.0.0.1:9", "--routing-poll-s", "0.5",
                    "--routing-lease-s", "0.9"])  # bounded: the lease fences nothing


def test_up_passes_the_release_consistency_to_its_gateway(tmp_path: Path) -> None:
    args = build_parser("up").parse_args(["up", "--simulate", "smollm2-cpu",
                                          "--release-consistency", "strict"])
    config = up._config(args, CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run"))
    at = config.gateway_args.index("--release-consistency")
    assert config.gateway_args[at + 1] == "strict"
    plain = build_parser("up").parse_args(["up", "--simulate", "smollm2-cpu"])
    assert "--release-consistency" not in up._config(
        plain, CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run")).gateway_args
