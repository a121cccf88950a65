"""What D does with blocks it cannot trust, and when P's blocks come back, between live
instances of the tiny model: a damaged block and every one after it are recomputed (counted,
never served), a peer with another KV layout is refused by name, a lease that nobody pulls or
acknowledges ends on time."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from live_server import wait_until
from pd_fleet import FLEET, Instance, comparable, decode, mixed, prefill, start_instance
from test_pd_live import LONG, body_of

from strata.model.loader import LoadedModel
from strata.protocol.pd import KV_PATH
from strata.server.pd.faults import FaultConfig


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> Instance:
    instance = start_instance(tiny_model)
    yield instance  # type: ignore[misc]
    instance.stop()


@pytest.mark.parametrize(("fault", "reason"), [({"corrupt_block": 2}, "checksum"),
                                               ({"corrupt_hash_block": 2}, "hash")])
@pytest.mark.parametrize(("shm_mb", "transport"), [(256, "shm"), (0, "http")])
def test_a_damaged_block_and_those_after_it_are_recomputed(tiny_model: LoadedModel,
                                                           reference: Instance,
                                                           fault: dict[str, int],
                                                           reason: str, shm_mb: int,
                                                           transport: str) -> None:
    """From P's shared-memory pool (a P on this host) as from the stream."""
    p = start_instance(tiny_model, faults=FaultConfig(**fault), shm_mb=shm_mb)
    d = start_instance(tiny_model)
    try:
        body = body_of(LONG, n=len(reason) + 100 * len(transport), temperature=0)
        handle = prefill(p, body)
        num_blocks = json.loads(handle)["num_blocks"]
        answer = decode(d, body, handle)
        assert comparable(answer.json()) == comparable(mixed(reference, body).json())
        assert d.metric("pd_blocks_recomputed_total", reason=reason) == num_blocks - 2
        assert d.metric("pd_pulls_total", transport=transport) == 1
        assert d.metric("pd_handoffs_total", side="decode", outcome="partial") == 1
        assert d.engine.stats().num_external_hit_tokens == 2 * 8  # blocks 0 and 1 only
        assert wait_until(lambda: p.num_held_blocks == 0)
    finally:
        p.stop()
        d.stop()


def test_a_peer_with_another_layout_is_refused_by_name(tiny_model: LoadedModel) -> None:
    p = start_instance(tiny_model, dtype="bfloat16")
    d = start_instance(tiny_model)
    d_alone = start_instance(tiny_model)
    try:
        body = body_of(LONG, n=7, temperature=0)
        answer = decode(d, body, prefill(p, body))
        assert answer.status_code == 200
        # P's bfloat16 token is never used: D answers as it would alone
        assert comparable(answer.json()) == comparable(mixed(d_alone, body).json())
        assert d.metric("pd_handshake_refusals_total", field="dtype") == 1
        assert d.metric("pd_handoffs_total", side="decode", outcome="local") == 1
        assert d.engine.stats().num_external_hit_tokens == 0
        assert wait_until(lambda: p.num_held_blocks == 0)  # D let P free them at once
    finally:
        for instance in (p, d, d_alone):
            instance.stop()


def test_blocks_nobody_pulls_are_freed_when_the_lease_ends(tiny_model: LoadedModel) -> None:
    p = start_instance(tiny_model, num_blocks=64, lease_s=0.5)
    try:
        handle = json.loads(prefill(p, body_of(LONG, n=9, temperature=0)))
        assert p.num_held_blocks == handle["num_blocks"] > 0
        granted = time.monotonic()
        assert wait_until(lambda: p.num_held_blocks == 0, timeout_s=5)
        assert time.monotonic() - granted <= 0.5 + 1.0  # lease + 1 s
        assert p.num_free_blocks == 64
        assert p.metric("pd_lease_releases_total", reason="unpulled") == 1  # nobody pulled
        pulled = httpx.get(f"{p.url}{KV_PATH}/{handle['handle']}", headers=FLEET)
        assert pulled.status_code == 404
    finally:
        p.stop()
