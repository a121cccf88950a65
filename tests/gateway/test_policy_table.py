"""The policy table (strata/gateway/routing/policies/__init__.py): the CLI's --policy choices are
its rows, a policy added with one row is chosen by name and routes requests, and consistent_hash
takes its bound and its ring from the session settings."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, view

from strata.commands import gateway as gateway_command
from strata.commands.env import CliEnv
from strata.errors import ConfigError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig, SessionRoutingConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import (
    POLICIES,
    ConsistentHashPolicy,
    RouteRequest,
    StatelessPolicy,
    create_policy,
    policy_names,
    register_policy,
)

ENV = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"))


class LastCandidatePolicy(StatelessPolicy):
    """A toy policy, as a real one would sit in its own module: always the last candidate."""

    name = "last_candidate"

    def choose(self, request: RouteRequest, candidates: Sequence[InstanceView]) -> InstanceView:
        return candidates[-1]


@pytest.fixture
def toy_row() -> Iterator[None]:
    register_policy("last_candidate", lambda context: LastCandidatePolicy())
    yield
    del POLICIES["last_candidate"]


def parse_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["gateway", "--instances", "http://127.0.0.1:1", *flags])


def test_the_cli_offers_every_row_of_the_table_and_nothing_else() -> None:
    assert policy_names()[0] == GatewayConfig().policy  # the default first
    for name in policy_names():
        assert gateway_command.build_config(parse_flags("--policy", name), ENV).policy == name
    with pytest.raises(SystemExit):
        parse_flags("--policy", "last_candidate")  # not registered here


def test_a_policy_registered_with_one_row_is_a_cli_choice_and_routes_requests(toy_row) -> None:
    config = gateway_command.build_config(parse_flags("--policy", "last_candidate"), ENV)
    upstreams = Upstreams(**{name: lambda request: json_answer({"choices": []})
                             for name in "abc"})
    app = create_gateway_app(config, FixedSource(view("a"), view("b"), view("c")),
                             transport=upstreams.transport(), clock=FakeClock(),
                             run_background=False)

    async def run() -> list[str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            answers = [await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                       for _ in range(3)]
        return [answer.headers["x-strata-instance"] for answer in answers]

    assert asyncio.run(run()) == ["c", "c", "c"]


def test_a_taken_name_is_refused_and_an_unknown_one_lists_the_table(toy_row) -> None:
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("round_robin", lambda context: LastCandidatePolicy())
    with pytest.raises(ConfigError, match="last_candidate, least_load, power_of_two"):
        create_policy("nope")


def test_consistent_hash_takes_epsilon_from_the_cli_and_vnodes_from_the_session_settings() -> None:
    config = gateway_command.build_config(
        parse_flags("--policy", "consistent_hash", "--session-epsilon", "1.0"), ENV)
    policy = create_policy(config.policy, config=config, rng=random.Random(0))
    assert isinstance(policy, ConsistentHashPolicy) and policy.epsilon == 1.0
    default = create_policy("consistent_hash")
    request = RouteRequest(session_id="chat-1")
    home = default.choose(request, [view("a"), view("b")]).instance_id
    other = "b" if home == "a" else "a"
    busy = [view(home, num_in_flight=2), view(other)]
    # 3 requests over 2 instances: eps 0.25 allows ceil(1.875) = 2 per instance, eps 1.0 three
    assert default.choose(request, busy).instance_id == other
    assert policy.choose(request, busy).instance_id == home

    sparse = GatewayConfig(sessions=SessionRoutingConfig(num_vnodes=7))
    ring_policy = create_policy("consistent_hash", config=sparse)
    assert isinstance(ring_policy, ConsistentHashPolicy)
    ring_policy.choose(request, [view("a"), view("b")])
    assert len(ring_policy.rings.ring.points) == 2 * 7


def test_the_dashboard_s_trace_url_is_an_http_template_with_the_trace_id() -> None:
    url = "http://jaeger:16686/trace/{trace_id}"
    assert gateway_command.build_config(parse_flags("--trace-url", url), ENV).trace_url == url
    for bad in ("http://jaeger:16686/trace/", "javascript:alert('{trace_id}')"):
        with pytest.raises(ConfigError, match="--trace-url wants an http"):
            gateway_command.build_config(parse_flags("--trace-url", bad), ENV)
