"""Key budgets over real sockets: two gateways over one simulated instance, their budget
windows in one real Redis. A key with tpm= is held across both gateways to its limit within one
request's tokens; a key with rpm= gets exactly its requests a minute, then a 429 with
Retry-After, the x-ratelimit-* headers and an OpenAI error body from either gateway, without
the instance seeing the refused request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from redis_server import redis_server, redis_url  # noqa: F401
from tenant_fleet import TenantFleet, chat, tenant_fleet, usage_of

TPM = 200
RPM = 3
HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens",
           "x-ratelimit-remaining-requests", "x-ratelimit-remaining-tokens",
           "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, redis_url: str  # noqa: F811
          ) -> Iterator[TenantFleet]:
    with tenant_fleet(tmp_path_factory.mktemp("budgets"), redis_url,
                      {"tokens": f"tpm={TPM}", "requests": f"rpm={RPM} tpm=100000",
                       "free": ""}) as running:
        yield running


@pytest.fixture(autouse=True)
def one_window() -> None:
    """Starts a test well inside a minute, so that its window does not reset under it."""
    left_s = 60 - time.time() % 60
    if left_s < 10:
        time.sleep(left_s + 0.1)


def post(fleet: TenantFleet, gateway: int, name: str, **body: object) -> httpx.Response:
    return httpx.post(f"{fleet.gateways[gateway].url}/v1/chat/completions",
                      json=chat(16, "spend my budget", **body),  # type: ignore[arg-type]
                      headers=fleet.headers(name), timeout=30)


def assert_refused(answer: httpx.Response, limit_header: str, limit: int) -> None:
    assert answer.status_code == 429, answer.text
    assert 1 <= int(answer.headers["retry-after"]) <= 60
    assert answer.headers[limit_header] == str(limit)
    assert answer.headers[limit_header.replace("-limit-", "-remaining-")] == "0"
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "per minute" in error["message"]
    assert "x-strata-instance" not in answer.headers


def test_a_token_budget_holds_across_two_gateways_within_one_request(
        fleet: TenantFleet) -> None:
    spent, last = 0, 0
    for i in range(40):
        answer = post(fleet, i % 2, "tokens", stream=i % 4 == 1, include_usage=True)
        if answer.status_code == 429:
            break
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ratelimit-limit-tokens"] == str(TPM)
        assert int(answer.headers["x-ratelimit-remaining-tokens"]) == TPM - spent
        assert "x-ratelimit-limit-requests" not in answer.headers  # the key has no rpm
        usage = usage_of(answer)
        assert usage is not None
        last = usage["total_tokens"]
        spent += last
    else:
        pytest.fail(f"40 requests and {spent} tokens on a {TPM}-token budget")
    assert spent - last < TPM <= spent  # refused only once spent, over by one request at most
    assert_refused(answer, "x-ratelimit-limit-tokens", TPM)
    assert_refused(post(fleet, 0, "tokens"), "x-ratelimit-limit-tokens", TPM)
    assert_refused(post(fleet, 1, "tokens"), "x-ratelimit-limit-tokens", TPM)
    assert post(fleet, 0, "free").status_code == 200  # another tenant's budget is its own
    rows = {row["tenant"]: row for row in fleet.usage(1, since="2m").json()["data"]}
    assert rows[fleet.tenant("tokens")]["total_tokens"] == spent
    assert rows[fleet.tenant("tokens")]["rate_limited"] == 3


def test_a_request_budget_gives_exactly_its_requests_then_429_before_the_instance(
        fleet: TenantFleet) -> None:
    for i in range(RPM):
        answer = post(fleet, i % 2, "requests", stream=True, include_usage=True)
        assert answer.status_code == 200, answer.text
        assert set(HEADERS) <= set(answer.headers)
        assert answer.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert answer.headers["x-ratelimit-remaining-requests"] == str(RPM - 1 - i)
        assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
    finished = fleet.instance_finished()
    for gateway in (0, 1):
        assert_refused(post(fleet, gateway, "requests"), "x-ratelimit-limit-requests", RPM)
    assert fleet.instance_finished() == finished  # the refused requests never reached it
