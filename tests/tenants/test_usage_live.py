"""Usage per tenant over real sockets: two gateways over one simulated instance, sharing one
usage store in a real Redis. Under concurrent load from two tenants through both gateways
(plain answers, streams with `include_usage`, streams without), GET /admin/usage on either
gateway equals the sum of the answers' own usage; a stream without a usage chunk counts its
request and no tokens. /admin/usage takes the admin key only and refuses a bad `since` with an
OpenAI error body; /metrics labels the top tenant and folds the rest into "other"."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from redis_server import redis_server, redis_url  # noqa: F401
from tenant_fleet import MODEL, TenantFleet, chat, tenant_fleet, usage_of

from strata.protocol.keys import auth_header

COUNTED = ("requests", "errors", "rate_limited", "prompt_tokens", "cached_tokens",
           "completion_tokens", "total_tokens")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_url: str  # noqa: F811
          ) -> Iterator[TenantFleet]:
    with tenant_fleet(tmp_path_factory.mktemp("usage"), redis_url, {"a": "", "b": ""},
                      "--usage-top-tenants", "1") as running:
        yield running


def load(fleet: TenantFleet) -> dict[str, dict[str, int]]:
    """Concurrent requests of tenants a and b through both gateways; the sum of each tenant's
    answers' usage (streams without a usage chunk: their requests alone)."""
    shapes: list[tuple[str, int, dict[str, Any]]] = []
    for i in range(6):
        prompt = f"tell me about tenant usage {i % 3}"  # repeats: cached prompt tokens
        shapes += [("a", i % 2, chat(12, prompt)),
                   ("a", (i + 1) % 2, chat(9, prompt, stream=True, include_usage=True)),
                   ("b", i % 2, chat(3, prompt, stream=True, include_usage=True)),
                   ("b", (i + 1) % 2, chat(2, prompt))]
    shapes += [("a", 0, chat(4, "no usage chunk", stream=True)),
               ("b", 1, chat(4, "no usage chunk", stream=True))]

    async def send(client: httpx.AsyncClient, name: str, gateway: int,
                   body: dict[str, Any]) -> tuple[str, httpx.Response]:
        answer = await client.post(f"{fleet.gateways[gateway].url}/v1/chat/completions",
                                   json=body, headers=fleet.headers(name))
        return name, answer

    async def all_at_once() -> list[tuple[str, httpx.Response]]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(send(client, *shape) for shape in shapes))

    sums = {name: dict.fromkeys(COUNTED, 0) for name in ("a", "b")}
    for name, answer in asyncio.run(all_at_once()):
        assert answer.status_code == 200, answer.text
        usage = usage_of(answer) or {}
        row = sums[name]
        row["requests"] += 1
        row["prompt_tokens"] += usage.get("prompt_tokens", 0)
        row["completion_tokens"] += usage.get("completion_tokens", 0)
        row["total_tokens"] += usage.get("total_tokens", 0)
        row["cached_tokens"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return sums


def test_usage_equals_the_sum_of_the_answers_across_two_gateways(fleet: TenantFleet) -> None:
    sums = load(fleet)
    assert sums["a"]["requests"] == 13 and sums["a"]["completion_tokens"] > 0
    assert sums["a"]["cached_tokens"] > 0  # the repeated prompts hit the prefix cache
    for gateway in (0, 1):
        answer = fleet.usage(gateway, since="5m")
        assert answer.status_code == 200, answer.text
        rows = {row["tenant"]: row for row in answer.json()["data"]}
        for name in ("a", "b"):
            row = rows[fleet.tenant(name)]
            assert row["model"] == MODEL
            assert {k: row[k] for k in COUNTED} == sums[name]
    only_b = fleet.usage(0, since="5m", tenant=fleet.tenant("b")).json()["data"]
    assert [row["tenant"] for row in only_b] == [fleet.tenant("b")]


def test_metrics_label_the_top_tenant_and_fold_the_rest_into_other(fleet: TenantFleet) -> None:
    load(fleet)  # a has the most tokens
    text = httpx.get(f"{fleet.gateways[0].url}/metrics", timeout=10).text
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines()
               if line.startswith("strata:gateway_tenant_requests_total{")}
    assert tenants == {fleet.tenant("a"), "other"}
    assert fleet.keys["a"] not in text and fleet.keys["b"] not in text


def test_admin_usage_takes_the_admin_key_and_a_sane_since(fleet: TenantFleet) -> None:
    url = f"{fleet.gateways[0].url}/admin/usage"
    assert httpx.get(url, timeout=10).status_code == 401
    refused = httpx.get(url, headers=auth_header(fleet.keys["a"]), timeout=10)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "insufficient_permissions"
    for since in ("yesterday", "-5m", "2026-13-40T00:00:00", str(int(time.time()) + 3600)):
        bad = fleet.usage(0, since=since)
        assert bad.status_code == 400, since
        error = bad.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("since:")
    ago = datetime.fromtimestamp(time.time() - 600, UTC)
    for since in (str(int(ago.timestamp())), ago.strftime("%Y-%m-%dT%H:%M:%SZ"),
                  ago.strftime("%Y-%m-%dT%H:%M:%S"), "90s", "1d"):
        assert fleet.usage(0, since=since).status_code == 200, since
    default = fleet.usage(0).json()
    assert default["until"] - default["since"] == pytest.approx(3600, abs=61)
