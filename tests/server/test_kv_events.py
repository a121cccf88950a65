"""The instance's kv-events feed: cursors, snapshots, heartbeats and the ring's bound, over a
real block event log; and the two routes over a real simulated engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from strata.engine.block_events import BlockEventLog
from strata.protocol.kv_events import CacheIdentity, EventsAnswer
from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.server.kv_events import KVEventFeed
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine
from strata.types import BlockHash

A, B, C = (BlockHash(bytes([i]) * 16) for i in (1, 2, 3))


def wire(answer: EventsAnswer | None) -> dict[str, Any] | None:
    """The answer as the route sends it."""
    return None if answer is None else answer.to_json()


def feed(max_batches: int = 4) -> tuple[KVEventFeed, BlockEventLog]:
    log = BlockEventLog()
    return KVEventFeed(log, CacheIdentity(16, "m@v"), epoch=7.5, max_batches=max_batches), log


def test_a_new_cursor_gets_a_snapshot_then_only_what_changed() -> None:
    events, log = feed()
    log.block_cached(A)
    first = wire(events.answer(None, None))
    assert first is not None and first["snapshot"] == {"seq": 1, "stored": A.hex()}
    assert first["seq"] == 1 and first["epoch"] == 7.5 and first["block_size"] == 16
    assert wire(events.answer(7.5, 1)) is None  # up to date
    log.block_cached(B)
    log.block_evicted(A)
    second = wire(events.answer(7.5, 1))
    assert second is not None and "snapshot" not in second
    assert second["batches"] == [{"seq": 2, "stored": B.hex(), "removed": A.hex()}]
    assert wire(events.answer(7.5, 2)) is None


def test_another_epoch_or_a_cursor_older_than_the_ring_gets_a_snapshot() -> None:
    events, log = feed(max_batches=2)
    wire(events.answer(None, None))
    for key in (A, B, C):
        log.block_cached(key)
        events.refresh()  # batches 2, 3, 4; the ring keeps 3 and 4
    assert [b["seq"] for b in wire(events.answer(7.5, 2))["batches"]] == [3, 4]  # type: ignore[index]
    old = wire(events.answer(7.5, 1))
    assert old is not None and old["snapshot"]["stored"] == (A + B + C).hex()
    restarted = wire(events.answer(3.0, 4))  # a cursor of a previous process
    assert restarted is not None and "snapshot" in restarted


def test_an_overflow_in_the_engine_log_resends_a_snapshot_to_every_cursor() -> None:
    log = BlockEventLog(max_pending=1)
    events = KVEventFeed(log, CacheIdentity(16, "m@v"), epoch=1.0)
    wire(events.answer(None, None))
    log.block_cached(A)
    log.block_cached(B)  # overflow: the next take is a snapshot
    answer = wire(events.answer(1.0, 1))
    assert answer is not None and answer["snapshot"]["stored"] == (A + B).hex()
    assert answer["num_dropped"] == 2


def test_an_idle_poll_waits_and_answers_a_heartbeat() -> None:
    events, log = feed()
    wire(events.answer(None, None))
    answer = asyncio.run(events.poll(7.5, 1, wait_s=0.05)).to_json()
    assert answer["batches"] == [] and "snapshot" not in answer and answer["seq"] == 1


def test_the_routes_over_a_simulated_engine() -> None:
    profile = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.0,
                             prefill_ms_per_token=0.0, decode_ms_base=0.0, decode_ms_per_seq=0.0)
    async_engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        profile, kv_blocks=64, max_model_len=256, namespace="sim@v2"))
    app = create_app(async_engine, tokenizer, ServerConfig(served_model_name="sim"))

    async def story() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://i") as client:
            body = {"model": "sim", "prompt": "the of and to " * 10, "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            events = (await client.get("/v1/strata/kv-events")).json()
            assert events["namespace"] == "sim@v2" and events["block_size"] == 16
            assert len(events["snapshot"]["stored"]) == 32 * 2  # 40 tokens: two full blocks
            spec = (await client.get("/v1/strata/tokenizer")).json()
            assert spec["fingerprint"] == events["tokenizer"]
            assert "<|im_start|>" in spec["chat_template"]
            bad = await client.get("/v1/strata/kv-events", params={"after": "x"})
            assert bad.status_code == 400

    try:
        asyncio.run(story())
    finally:
        asyncio.run(async_engine.shutdown(1.0))


@pytest.mark.parametrize("path", ["/v1/strata/kv-events", "/v1/strata/tokenizer"])
def test_an_instance_that_publishes_nothing_answers_404(path: str) -> None:
    async_engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.0,
                       prefill_ms_per_token=0.0, decode_ms_base=0.0, decode_ms_per_seq=0.0),
        kv_blocks=16, enable_prefix_caching=False))
    app = create_app(async_engine, tokenizer, ServerConfig(served_model_name="sim"))
    app.state.instance.prefix.tokenizer = None  # a tokenizer that cannot be exported

    async def get() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://i") as client:
            return (await client.get(path)).status_code

    try:
        assert asyncio.run(get()) == 404
    finally:
        asyncio.run(async_engine.shutdown(1.0))
