"""Session routing stories: gateway apps over scripted instances (httpx.MockTransport), an
injected clock and one shared pin store."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest
from gateway_fakes import FakeClock, FixedSource, Upstreams, json_answer, view

from strata.errors import PinStoreError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig, SessionRoutingConfig
from strata.gateway.path.sessions import PinnedSessionPolicy, SessionRouter
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.policies import RoundRobinPolicy, RouteRequest
from strata.state.pins import MemoryPinStore, PinStore

SEEN: list[dict[str, str]] = []


def answer(request: httpx.Request) -> httpx.Response:
    SEEN.append({"host": request.url.host, "path": request.url.path,
                 "moved": request.headers.get("x-strata-session-moved", ""),
                 "session": request.headers.get("x-session-id", "")})
    return json_answer({"object": "chat.completion", "choices": []})


def config(mode: str = "sticky", **fields: object) -> GatewayConfig:
    sessions = SessionRoutingConfig(mode=mode, counts_max_age_s=0.0)
    return GatewayConfig(policy="round_robin", sessions=sessions, **fields)  # type: ignore[arg-type]


class Fleet:
    """Gateway apps over the same fake instances and one pin store."""

    def __init__(self, views: list[InstanceView], *, mode: str = "sticky",
                 pins: PinStore | None = None, num_gateways: int = 1) -> None:
        SEEN.clear()
        self.views = views
        self.clock = FakeClock()
        self.pins = pins or MemoryPinStore()
        upstreams = Upstreams(**{v.instance_id: answer for v in views})
        source = FixedSource(*views)
        self.apps = [create_gateway_app(config(mode), source, transport=upstreams.transport(),
                                        clock=self.clock, run_background=False,
                                        pin_store=self.pins) for _ in range(num_gateways)]

    async def chat(self, session: str | None, *, gateway: int = 0,
                   in_body: bool = False) -> httpx.Response:
        body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        headers = {}
        if session is not None and in_body:
            body["session_id"] = session
        elif session is not None:
            headers["X-Session-Id"] = session
        return await self.call("POST", "/v1/chat/completions", gateway, json.dumps(body), headers)

    async def call(self, method: str, path: str, gateway: int = 0, body: str | None = None,
                   headers: dict[str, str] | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.apps[gateway])
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.request(method, path, content=body, headers=headers)


def run(story: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(story())


def served(response: httpx.Response) -> tuple[str, str]:
    return response.headers["x-strata-instance"], response.headers["x-strata-session-routing"]


def test_a_session_stays_on_its_instance_and_other_requests_use_the_policy() -> None:
    fleet = Fleet([view("a"), view("b"), view("c")])

    async def story() -> None:
        first = served(await fleet.chat("chat-1"))
        home = first[0]
        assert first == (home, "placed")
        for _ in range(4):
            assert served(await fleet.chat("chat-1")) == (home, "pinned")
        assert served(await fleet.chat("chat-1", in_body=True)) == (home, "pinned")
        assert await fleet.pins.get("chat-1") == home
        plain = [(await fleet.chat(None)) for _ in range(3)]
        assert [r.headers["x-strata-instance"] for r in plain] == ["a", "b", "c"]
        assert "x-strata-session-routing" not in plain[0].headers
        assert SEEN[1]["session"] == "chat-1"  # forwarded untouched

    run(story)


def test_an_ejected_instance_moves_its_session_once_and_the_pin_is_rewritten() -> None:
    fleet = Fleet([view("a"), view("b"), view("c")])

    async def story() -> None:
        home, _ = served(await fleet.chat("chat-2"))
        victim = next(v for v in fleet.views if v.instance_id == home)
        victim.ejected_until = fleet.clock.now + 30.0
        new_home, outcome = served(await fleet.chat("chat-2"))
        assert (outcome, new_home != home) == ("moved", True)
        assert await fleet.pins.get("chat-2") == new_home
        victim.ejected_until = 0.0  # back: the session does not move back
        assert served(await fleet.chat("chat-2")) == (new_home, "pinned")

    run(story)


def test_a_turn_retried_off_its_pin_says_rerouted_and_the_pin_stays() -> None:
    fleet = Fleet([view("a"), view("b"), view("c")])
    refuse = {"host": ""}

    def flaky(request: httpx.Request) -> httpx.Response:
        if request.url.host == refuse["host"]:
            refuse["host"] = ""  # fails once, as a just-killed instance does
            raise httpx.ConnectError("connection refused", request=request)
        return answer(request)

    upstreams = Upstreams(**{v.instance_id: flaky for v in fleet.views})
    fleet.apps = [create_gateway_app(config(), FixedSource(*fleet.views),
                                     transport=upstreams.transport(), clock=fleet.clock,
                                     run_background=False, pin_store=fleet.pins)]

    async def story() -> None:
        home, _ = served(await fleet.chat("chat-r"))
        refuse["host"] = home
        other, outcome = served(await fleet.chat("chat-r"))
        assert other != home and outcome == "rerouted"
        assert await fleet.pins.get("chat-r") == home  # one failure does not move a session
        assert served(await fleet.chat("chat-r")) == (home, "pinned")

    run(story)


def test_two_gateways_over_one_pin_store_agree() -> None:
    fleet = Fleet([view("a"), view("b"), view("c"), view("d")], num_gateways=2)

    async def story() -> None:
        homes = {}
        for n in range(12):
            homes[f"s{n}"] = served(await fleet.chat(f"s{n}", gateway=n % 2))[0]
        for n in range(12):
            assert served(await fleet.chat(f"s{n}", gateway=1 - n % 2)) == (homes[f"s{n}"],
                                                                           "pinned")
        counts = await fleet.pins.counts()
        assert sum(counts.values()) == 12 and max(counts.values()) <= 4  # ceil(1.25 * 12 / 4)

    run(story)


def test_hybrid_tells_the_instance_and_the_client_that_a_session_moved() -> None:
    fleet = Fleet([view("a"), view("b")], mode="hybrid")

    async def story() -> None:
        home, _ = served(await fleet.chat("chat-3"))
        next(v for v in fleet.views if v.instance_id == home).state = "draining"
        moved = await fleet.chat("chat-3")
        assert served(moved)[1] == "moved" and moved.headers["x-strata-session-moved"] == "1"
        again = await fleet.chat("chat-3")
        assert served(again)[1] == "pinned" and "x-strata-session-moved" not in again.headers
        assert [s["moved"] for s in SEEN] == ["", "1", ""]

    run(story)


def test_sticky_mode_moves_without_the_moved_header() -> None:
    fleet = Fleet([view("a"), view("b")], mode="sticky")

    async def story() -> None:
        home, _ = served(await fleet.chat("chat-4"))
        fleet.views[0 if home == "a" else 1].state = "dead"
        response = await fleet.chat("chat-4")
        assert served(response)[1] == "moved" and "x-strata-session-moved" not in response.headers
        assert SEEN[-1]["moved"] == ""

    run(story)


def test_a_session_on_an_instance_over_the_bound_moves() -> None:
    fleet = Fleet([view("a"), view("b")])

    async def story() -> None:
        for n in range(9):  # other gateways pinned 9 sessions on a, 1 on b
            await fleet.pins.set_if(f"old{n}", "a", expected=None)
        await fleet.pins.set_if("mine", "b", expected=None)
        assert served(await fleet.chat("mine")) == ("b", "pinned")
        await fleet.pins.set_if("heavy", "a", expected=None)  # a: 10 > ceil(1.25 * 11 / 2) = 7
        assert served(await fleet.chat("heavy")) == ("b", "moved")
        assert (await fleet.pins.counts()) == {"a": 9, "b": 2}

    run(story)


@pytest.mark.parametrize("mode", ["none", "external"])
def test_without_session_routing_the_session_id_changes_nothing(mode: str) -> None:
    fleet = Fleet([view("a"), view("b")], mode=mode)

    async def story() -> None:
        responses = [await fleet.chat("chat-5") for _ in range(2)]
        assert [r.headers["x-strata-instance"] for r in responses] == ["a", "b"]
        assert "x-strata-session-routing" not in responses[0].headers
        assert SEEN[0]["session"] == "chat-5"
        assert await fleet.pins.counts() == {}

    run(story)


class LosingPins(MemoryPinStore):
    """Another gateway pins the session to `winner` just before our first write."""

    def __init__(self, winner: str) -> None:
        super().__init__()
        self.winner = winner

    async def set_if(self, session_id: str, instance_id: str, *, expected: str | None) -> bool:
        if self.winner:
            await super().set_if(session_id, self.winner, expected=expected)
            self.winner = ""
        return await super().set_if(session_id, instance_id, expected=expected)


def test_a_gateway_that_loses_the_pin_race_follows_the_winner() -> None:
    views = [view("a"), view("b"), view("c")]
    natural = Fleet(views)

    async def story() -> None:
        home, _ = served(await natural.chat("chat-6"))
        other = "b" if home != "b" else "c"
        racing = Fleet(views, pins=LosingPins(other))
        assert served(await racing.chat("chat-6")) == (other, "placed")
        assert await racing.pins.get("chat-6") == other

    run(story)


class BrokenPins(MemoryPinStore):
    async def get(self, session_id: str) -> str | None:
        raise PinStoreError("redis pin store redis://x: connection refused")


def test_without_a_pin_store_sessions_still_go_to_their_hash_instance() -> None:
    fleet = Fleet([view("a"), view("b"), view("c")], pins=BrokenPins())

    async def story() -> None:
        first = served(await fleet.chat("chat-7"))
        assert first[1] == "unpinned"
        assert served(await fleet.chat("chat-7")) == first

    run(story)


def test_session_endpoints_pass_through_and_delete_unpins() -> None:
    fleet = Fleet([view("a"), view("b")])

    async def story() -> None:
        await fleet.chat("chat-8")
        listed = await fleet.call("GET", "/v1/sessions?limit=5")
        shown = await fleet.call("GET", "/v1/sessions/chat-8")
        assert listed.status_code == shown.status_code == 200
        assert await fleet.pins.get("chat-8") is not None
        deleted = await fleet.call("DELETE", "/v1/sessions/chat-8")
        assert deleted.status_code == 200
        assert await fleet.pins.get("chat-8") is None
        assert [s["path"] for s in SEEN] == ["/v1/chat/completions", "/v1/sessions",
                                             "/v1/sessions/chat-8", "/v1/sessions/chat-8"]

    run(story)


def test_session_routing_config_names_the_valid_modes() -> None:
    with pytest.raises(ValueError, match="none, external, sticky, hybrid"):
        SessionRoutingConfig(mode="magic")
    modes = ("none", "external", "sticky", "hybrid")  # each valid one is accepted
    assert [m for m in modes if SessionRoutingConfig(mode=m).is_pinning] == ["sticky", "hybrid"]
    router = SessionRouter(SessionRoutingConfig(mode="sticky"), MemoryPinStore())
    assert asyncio.run(router.place("s", [view("a")])).instance_id == "a"


def test_the_cli_flags_build_the_session_routing_config() -> None:
    from test_gateway_live import ENV, parse_flags

    from strata.commands import gateway as gateway_command

    args = parse_flags("--instances", "http://127.0.0.1:1", "--policy", "consistent_hash",
                       "--session-routing", "hybrid", "--session-store",
                       "redis://127.0.0.1:6379/0", "--session-epsilon", "0.5",
                       "--session-pin-ttl-s", "60")
    built = gateway_command.build_config(args, ENV)
    assert built.policy == "consistent_hash"
    assert (built.sessions.mode, built.sessions.store_url, built.sessions.epsilon,
            built.sessions.pin_ttl_s) == ("hybrid", "redis://127.0.0.1:6379/0", 0.5, 60.0)
    assert gateway_command.build_config(
        parse_flags("--instances", "http://127.0.0.1:1"), ENV).sessions.mode == "none"


def test_the_pinned_session_policy_sends_a_session_to_its_placement_and_the_rest_on() -> None:
    sessions = SessionRouter(SessionRoutingConfig(mode="sticky"), MemoryPinStore(),
                             clock=FakeClock())
    policy = PinnedSessionPolicy(sessions, RoundRobinPolicy())
    views = [view("a"), view("b"), view("c")]
    home = asyncio.run(sessions.place("s", views)).instance_id
    turn = RouteRequest(session_id="s")
    for _ in range(2):
        chosen = policy.choose(turn, views)
        assert chosen.instance_id == home
        policy.on_request_routed(turn, chosen)
    # the hooks reached round robin: two routed, so a request without a session goes to c
    assert policy.choose(RouteRequest(), views).instance_id == "c"
    # a retry after the placement failed: the bounded consistent hash over the others
    rest = [v for v in views if v.instance_id != home]
    assert policy.choose(turn, rest).instance_id == sessions.prefer("s", rest).instance_id != home
