"""Admission: a cap in flight, a FIFO queue, 429 when full, 503 after the queue timeout."""

from __future__ import annotations

import asyncio

import pytest

from strata.errors import OverloadedError
from strata.gateway.config import AdmissionConfig
from strata.gateway.path.admission import Admission


async def settle() -> None:
    for _ in range(10):  # let woken waiters run (wait_for + shield take a few loop turns)
        await asyncio.sleep(0)


def test_cap_then_queue_in_fifo_order_then_429_when_full() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=2, max_queue=2, queue_timeout_s=30.0))
    order: list[str] = []

    async def request(name: str) -> None:
        await admission.acquire()
        order.append(name)

    async def story() -> None:
        await request("a")
        await request("b")
        waiting = [asyncio.create_task(request(n)) for n in ("c", "d")]
        await settle()
        assert (admission.num_in_flight, admission.num_queued) == (2, 2)
        with pytest.raises(OverloadedError) as refused:
            await admission.acquire()
        assert (refused.value.status_code, refused.value.retry_after_s) == (429, 1.0)
        admission.release()
        await settle()
        assert order == ["a", "b", "c"]
        admission.release()
        await asyncio.gather(*waiting)
        assert order == ["a", "b", "c", "d"]
        assert (admission.num_in_flight, admission.num_queued) == (2, 0)
        admission.release()
        admission.release()
        assert admission.num_in_flight == 0

    asyncio.run(story())


def test_a_request_that_waits_past_the_timeout_gets_503_and_leaves_the_queue() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=0.05))

    async def story() -> None:
        await admission.acquire()
        with pytest.raises(OverloadedError) as timed_out:
            await admission.acquire()
        assert timed_out.value.status_code == 503
        assert "waited 0.05s in the gateway queue" in timed_out.value.message
        assert (admission.num_in_flight, admission.num_queued) == (1, 0)
        admission.release()
        assert admission.num_in_flight == 0

    asyncio.run(story())


def test_a_cancelled_waiter_gives_its_place_back() -> None:
    admission = Admission(AdmissionConfig(max_in_flight=1, max_queue=4, queue_timeout_s=30.0))

    async def story() -> None:
        async with admission.slot():
            task = asyncio.create_task(admission.acquire())
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert admission.num_queued == 0
        assert admission.num_in_flight == 0

    asyncio.run(story())
