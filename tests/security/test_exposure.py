"""Security defaults: a server that listens beyond the loopback needs client keys and an admin
key (or --insecure); the dashboard's data takes a key, and only what the admin API takes sees
the buttons and the fleet's insides (instance URLs)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from strata.cli import main
from strata.errors import ConfigError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.control.dashboard.page import HIDDEN
from strata.gateway.routing.sources import StaticSource
from strata.protocol.auth import check_exposure, is_loopback
from strata.sim.profile import LatencyProfile


@pytest.mark.parametrize(("host", "expected"), [("127.0.0.1", True), ("127.3.4.5", True),
                                                ("::1", True), ("localhost", True),
                                                ("0.0.0.0", False), ("10.0.0.7", False),
                                                ("::", False), ("example.org", False)])
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_beyond_the_loopback_both_kinds_of_key_are_needed_unless_insecure() -> None:
    check_exposure("x", "127.0.0.1", (), (), insecure=False)
    check_exposure("x", "0.0.0.0", ("client",), ("admin",), insecure=False)
    check_exposure("x", "0.0.0.0", (), (), insecure=True)
    with pytest.raises(ConfigError, match="without API keys and an admin key"):
        check_exposure("strata gateway", "0.0.0.0", (), (), insecure=False)
    with pytest.raises(ConfigError, match="without an admin key.*--insecure"):
        check_exposure("strata serve", "0.0.0.0", ("client",), (), insecure=False)


def test_serve_and_gateway_refuse_to_start_open_beyond_the_loopback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    LatencyProfile(model="m", source="synthetic", prefill_ms_base=0.0, prefill_ms_per_token=0.0,
                   decode_ms_base=0.0, decode_ms_per_seq=0.0).save(profile)
    assert main(["serve", "--simulate", str(profile), "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "strata serve listens on 0.0.0.0" in capsys.readouterr().err
    assert main(["gateway", "--instances", "http://127.0.0.1:9", "--host", "0.0.0.0"]) == 1
    assert "strata gateway listens on 0.0.0.0" in capsys.readouterr().err
    assert main(["up", "--simulate", str(profile), "--host", "0.0.0.0"]) == 1
    assert "strata up listens on 0.0.0.0" in capsys.readouterr().err


def snapshot(config: GatewayConfig, key: str | None) -> httpx.Response:
    source = StaticSource(("http://10.0.0.7:8000",), httpx.AsyncClient())
    app = create_gateway_app(config, source, run_background=False)

    async def call() -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            await app.state.gateway.source.refresh()
            return await client.get("/dashboard/data", headers=headers)

    return asyncio.run(call())


def test_the_dashboards_data_takes_a_key_and_shows_the_insides_to_the_admin_only() -> None:
    config = GatewayConfig(api_keys=("client",), admin_keys=("admin",),
                           internal_keys=("internal",))
    assert snapshot(config, None).status_code == 401
    assert snapshot(config, "nobody's").status_code == 401
    admin = snapshot(config, "admin").json()
    assert admin["access"] == {"admin": True, "keyed": True}
    assert admin["instances"][0]["url"] == "http://10.0.0.7:8000"
    for key in ("client", "internal"):
        viewer = snapshot(config, key).json()
        assert viewer["access"] == {"admin": False, "keyed": True}
        assert viewer["instances"][0]["url"] == HIDDEN
        assert "10.0.0.7" not in json.dumps(viewer)
    open_gateway = snapshot(GatewayConfig(), None).json()  # loopback, no keys: its admin API too
    assert open_gateway["access"] == {"admin": True, "keyed": False}
    admin_only = GatewayConfig(admin_keys=("admin",))  # no client keys: the data is open ...
    assert snapshot(admin_only, None).json()["access"] == {"admin": False, "keyed": True}
    assert snapshot(admin_only, None).json()["instances"][0]["url"] == HIDDEN  # ... read-only
