"""Sticky sessions end to end over real sockets: two gateways (built from the CLI flags) sharing
one SQLite pin store, three tiny-model instances behind cuttable relays."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_fleet import Fleet, Relay, ServedApp, serve_app
from live_server import MODEL_NAME, load_tiny, start_server, wait_until
from test_gateway_live import ENV, instance_id, parse_flags
from tiny_models import make_tiny_model_dir

from strata.commands import gateway as gateway_command
from strata.gateway.app import create_gateway_app
from strata.gateway.config import EjectionConfig
from strata.gateway.routing.sources import StaticSource


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, list[ServedApp]]]:
    model = load_tiny(make_tiny_model_dir(tmp_path / "tiny"))
    running = Fleet([], [])
    gateways: list[ServedApp] = []
    try:
        for _ in range(3):
            running.servers.append(start_server(model))
            running.relays.append(Relay(int(running.servers[-1].base_url.rsplit(":", 1)[1])))
        for _ in range(2):
            gateways.append(_gateway(running.relays, f"sqlite://{tmp_path}/pins.db"))
        yield running, gateways
    finally:
        for gateway in gateways:
            gateway.stop()
        running.stop()


def _gateway(relays: list[Relay], store_url: str) -> ServedApp:
    args = parse_flags("--instances", *[r.url for r in relays], "--port", "0",
                       "--health-check-interval-s", "0.2", "--session-routing", "sticky",
                       "--session-store", store_url)
    config = dataclasses.replace(gateway_command.build_config(args, ENV),
                                 ejection=EjectionConfig(base_ejection_s=60.0),
                                 read_timeout_s=30.0)
    assert config.sessions.mode == "sticky" and config.sessions.store_url == store_url
    control = httpx.AsyncClient(timeout=1.0)
    return serve_app(create_gateway_app(config, StaticSource(config.instance_urls, control),
                                        control_client=control))


def turn(gateway: ServedApp, session: str, n: int) -> tuple[str, str]:
    body = {"model": MODEL_NAME, "prompt": f"turn {n}", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body,
                          headers={"X-Session-Id": session}, timeout=30.0)
    assert response.status_code == 200, response.text
    return response.headers["x-strata-instance"], response.headers["x-strata-session-routing"]


def is_ejected(gateway: ServedApp, relay: Relay) -> bool:
    listed = httpx.get(f"{gateway.url}/admin/instances").json()["instances"]
    return any(i["instance_id"] == instance_id(relay) and i["ejected"] for i in listed)


def test_turns_through_either_gateway_stay_put_and_move_once_when_the_instance_dies(
        fleet: tuple[Fleet, list[ServedApp]]) -> None:
    instances, gateways = fleet
    assert wait_until(lambda: all(
        len(httpx.get(f"{g.url}/admin/instances").json()["instances"]) == 3 for g in gateways))
    turns = [turn(gateways[n % 2], "story", n) for n in range(6)]
    home = turns[0][0]
    assert turns == [(home, "placed")] + [(home, "pinned")] * 5
    victim = next(r for r in instances.relays if instance_id(r) == home)
    victim.kill()
    assert wait_until(lambda: all(is_ejected(g, victim) for g in gateways))
    after = [turn(gateways[n % 2], "story", n) for n in range(6)]
    new_home = after[0][0]
    assert new_home != home
    assert after == [(new_home, "moved")] + [(new_home, "pinned")] * 5
