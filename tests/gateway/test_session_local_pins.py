"""Reusing this gateway's recent placement (`local_pin_max_age_s`): no pin-store read inside the
age, a pin another gateway wrote followed once it has passed, never an instance that stopped
being a candidate."""

from __future__ import annotations

import asyncio

import pytest
from gateway_fakes import FakeClock, view

from strata.errors import ConfigError
from strata.gateway.config import SessionRoutingConfig
from strata.gateway.path.sessions import MOVED, PINNED, PLACED, SessionRouter
from strata.state.pins import MemoryPinStore


class CountingPinStore(MemoryPinStore):
    """The in-process pin store, counting its reads."""

    def __init__(self) -> None:
        super().__init__()
        self.num_gets = 0

    async def get(self, session_id: str) -> str | None:
        self.num_gets += 1
        return await super().get(session_id)


def router(pins: CountingPinStore, clock: FakeClock, age_s: float = 1.0) -> SessionRouter:
    config = SessionRoutingConfig(mode="sticky", local_pin_max_age_s=age_s,
                                  counts_max_age_s=10.0**9)
    return SessionRouter(config, pins, clock=clock)


def test_a_recent_placement_is_reused_without_reading_the_store() -> None:
    pins, clock = CountingPinStore(), FakeClock()
    sessions, views = router(pins, clock), [view("a"), view("b")]

    async def story() -> None:
        first = await sessions.place("s", views)
        assert first.outcome == PLACED and pins.num_gets == 1
        clock.advance(0.5)
        again = await sessions.place("s", views)
        assert (again.instance_id, again.outcome) == (first.instance_id, PINNED)
        assert pins.num_gets == 1
        clock.advance(0.5)  # the age counts from the store read, not from the reuse
        await sessions.place("s", views)
        assert pins.num_gets == 2

    asyncio.run(story())


def test_a_pin_written_by_another_gateway_is_followed_within_the_age() -> None:
    pins, clock = CountingPinStore(), FakeClock()
    mine, views = router(pins, clock), [view("a"), view("b")]

    async def story() -> None:
        home = (await mine.place("s", views)).instance_id
        other = "b" if home == "a" else "a"
        assert await pins.set_if("s", other, expected=home)  # another gateway moved it
        clock.advance(0.5)
        assert (await mine.place("s", views)).instance_id == home
        clock.advance(0.5)
        followed = await mine.place("s", views)
        assert (followed.instance_id, followed.outcome) == (other, PINNED)

    asyncio.run(story())


def test_a_placement_whose_instance_left_the_candidates_is_not_reused() -> None:
    pins, clock = CountingPinStore(), FakeClock()
    sessions, views = router(pins, clock), [view("a"), view("b")]

    async def story() -> None:
        home = (await sessions.place("s", views)).instance_id
        rest = [v for v in views if v.instance_id != home]
        moved = await sessions.place("s", rest)
        assert (moved.instance_id, moved.outcome) == (rest[0].instance_id, MOVED)
        assert pins.num_gets == 2 and await pins.get("s") == rest[0].instance_id

    asyncio.run(story())


def test_with_age_zero_every_placement_reads_the_store() -> None:
    pins, clock = CountingPinStore(), FakeClock()
    sessions, views = router(pins, clock, age_s=0.0), [view("a"), view("b")]

    async def story() -> None:
        for _ in range(3):
            await sessions.place("s", views)
        assert pins.num_gets == 3

    asyncio.run(story())


def test_a_negative_age_is_refused_with_its_name() -> None:
    with pytest.raises(ConfigError, match="local_pin_max_age_s must be >= 0, got -1"):
        SessionRoutingConfig(mode="sticky", local_pin_max_age_s=-1)


def test_a_placement_whose_instance_went_over_the_bound_is_not_reused() -> None:
    pins, clock = CountingPinStore(), FakeClock()
    config = SessionRoutingConfig(mode="sticky", local_pin_max_age_s=1.0, counts_max_age_s=0.0)
    sessions, views = SessionRouter(config, pins, clock=clock), [view("a"), view("b")]

    async def story() -> None:
        home = (await sessions.place("s", views)).instance_id
        other = "b" if home == "a" else "a"
        for n in range(4):  # other gateways pile sessions on `home`: 5 of 5, over the bound
            assert await pins.set_if(f"x{n}", home, expected=None)
        clock.advance(0.1)
        moved = await sessions.place("s", views)
        assert (moved.instance_id, moved.outcome) == (other, MOVED)
        assert pins.num_gets == 2 and await pins.get("s") == other

    asyncio.run(story())


def test_the_cli_flag_sets_the_age() -> None:
    from test_gateway_command import ENV, parse_flags

    from strata.commands import gateway as gateway_command

    def age_s(*flags: str) -> float:
        args = parse_flags("--instances", "http://127.0.0.1:1", *flags)
        return gateway_command.build_config(args, ENV).sessions.local_pin_max_age_s

    assert (age_s(), age_s("--session-local-pin-age-s", "0")) == (1.0, 0.0)
    assert age_s("--session-local-pin-age-s", "2.5") == 2.5
    with pytest.raises(SystemExit) as exited:
        parse_flags("--session-local-pin-age-s", "-1")
    assert exited.value.code == 2
