"""The stall watch: an attempt waiting on a silent instance is ended when a probe of that
instance fails, and only then (an injected clock; probes over httpx.MockTransport)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from gateway_fakes import FakeClock, view

from strata.gateway.config import ResumeConfig
from strata.gateway.upstream.stalls import StallWatch

CONFIG = ResumeConfig(stall_s=0.5, stall_probe_timeout_s=0.2)


def watch(alive: set[str], clock: FakeClock, ended: list[tuple[str, int]]) -> StallWatch:
    def health(request: httpx.Request) -> httpx.Response:
        if request.url.host not in alive:
            raise httpx.ConnectTimeout("no answer", request=request)
        return httpx.Response(200, json={"status": "ok"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(health))
    return StallWatch(CONFIG, client, clock,
                      on_dead=lambda v, n: ended.append((v.instance_id, n)))


async def settle(stalls: StallWatch) -> None:
    await asyncio.gather(*stalls.probes.values())


def test_a_wait_on_a_silent_instance_that_fails_its_probe_is_ended() -> None:
    async def run() -> None:
        clock, ended = FakeClock(), []
        stalls = watch({"b"}, clock, ended)
        dead, alive = stalls.open(view("a")), stalls.open(view("b"))
        never: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        other: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        waits = [asyncio.create_task(dead.wait(never)), asyncio.create_task(alive.wait(other))]
        await asyncio.sleep(0)
        clock.advance(0.4)
        await stalls.sweep()
        assert stalls.probes == {}  # silent for less than stall_s: nobody is probed
        clock.advance(0.2)
        await stalls.sweep()
        assert sorted(stalls.probes) == ["a", "b"]
        await settle(stalls)
        with pytest.raises(TimeoutError):
            await waits[0]
        assert dead.was_ended and ended == [("a", 1)]
        assert not waits[1].done()  # b answered its probe: a long prefill, left alone
        other.set_result(b"chunk")
        assert await waits[1] == b"chunk"
        stalls.close(dead)
        stalls.close(alive)
        assert stalls.watched == {}
        await stalls.client.aclose()

    asyncio.run(run())


def test_an_attempt_not_waiting_on_its_instance_is_never_a_stall() -> None:
    async def run() -> None:
        clock, ended = FakeClock(), []
        stalls = watch(set(), clock, ended)
        watched = stalls.open(view("a"))  # sent, now relaying to a slow client
        clock.advance(5.0)
        await stalls.sweep()
        assert stalls.probes == {} and ended == []
        data = asyncio.get_running_loop().create_future()
        data.set_result(b"x")
        assert await watched.wait(data) == b"x"
        pending = asyncio.create_task(watched.wait(asyncio.Event().wait()))
        await asyncio.sleep(0)
        clock.advance(0.3)
        await stalls.sweep()  # waiting since data came 0.3 s ago: not silent long enough
        assert stalls.probes == {}
        pending.cancel()
        await stalls.client.aclose()

    asyncio.run(run())
