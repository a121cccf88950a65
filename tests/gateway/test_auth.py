"""API keys: 401 without the right key, 429 over the per-key rate, exempt probes."""

from __future__ import annotations

import asyncio
import hmac

import httpx
import pytest
from gateway_fakes import FakeClock
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from strata.errors import ConfigError
from strata.protocol.auth import ApiKeyAuth, match_key


async def _ok(request: object) -> PlainTextResponse:
    return PlainTextResponse("ok")


def app_with_auth(**options: object) -> Starlette:
    app = Starlette(routes=[Route("/v1/models", _ok), Route("/health", _ok)])
    app.add_middleware(ApiKeyAuth, **options)  # type: ignore[arg-type]
    return app


def get(app: Starlette, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(call())


def test_missing_or_wrong_key_is_401_with_an_openai_body_and_the_right_key_passes() -> None:
    app = app_with_auth(keys=["k-one", "k-two"])
    for key in (None, "k-three", "k-one-and-more"):
        response = get(app, "/v1/models", key)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert get(app, "/v1/models", "k-two").text == "ok"
    assert get(app, "/health").text == "ok"  # probes need no key


def test_each_key_has_its_own_token_bucket() -> None:
    clock = FakeClock()
    app = app_with_auth(keys=["a", "b"], rate_limit_per_s=2.0, burst=2, clock=clock)
    assert [get(app, "/v1/models", "a").status_code for _ in range(3)] == [200, 200, 429]
    limited = get(app, "/v1/models", "a")
    assert limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert get(app, "/v1/models", "b").status_code == 200  # another key is not limited
    clock.advance(0.5)  # one token back at 2/s
    assert [get(app, "/v1/models", "a").status_code for _ in range(2)] == [200, 429]


def test_keys_are_compared_in_constant_time_against_every_key() -> None:
    seen: list[tuple[bytes, bytes]] = []

    def recording(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return hmac.compare_digest(a, b)

    assert match_key(b"k2", [b"k1", b"k2", b"k3"], recording) == 1
    assert seen == [(b"k2", b"k1"), (b"k2", b"k2"), (b"k2", b"k3")]  # no early exit
    app = app_with_auth(keys=["k1"])
    middleware = ApiKeyAuth(app, ["k1"])
    assert middleware.compare is hmac.compare_digest


def test_no_keys_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="non-empty list"):
        ApiKeyAuth(app_with_auth(keys=["x"]), [])
