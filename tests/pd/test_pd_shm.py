"""KV by reference between instances on one host (strata/server/pd/shm.py): P's pool in
shared memory (slots keyed by chain hash, shared and counted, all or nothing, freed with the
lease), another process mapping it only with its token, and live instances of the tiny model in
the default dtype whose hand-off reads the pool and answers exactly as a mixed instance, falling
back to the stream when P's pool is full."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from live_server import wait_until
from pd_fleet import Instance, comparable, decode, mixed, prefill, start_instance
from test_pd_live import LONG, body_of

from strata.errors import KVPoolFullError
from strata.model.loader import LoadedModel
from strata.server.pd.shm import PAGE, STAMP, ShmPeers, ShmPool
from strata.types import BlockHash


def _hash(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 16)


@pytest.fixture
def pool() -> ShmPool:
    made = ShmPool.create(PAGE * 5)
    if made is None:
        pytest.skip("no memfd_create on this platform: hand-offs use the stream")
    yield made  # type: ignore[misc]
    made.close()


def test_slots_are_shared_by_hash_and_freed_with_the_last_lease(pool: ShmPool) -> None:
    a, b, c = (_hash(i) for i in range(3))
    first = pool.put("lease-1", [(a, b"A" * 100), (b, b"B" * 200)])
    assert pool.num_slots == 4 and pool.num_used == 2  # the header takes a page
    second = pool.put("lease-2", [(b, b"B" * 200), (c, b"C" * 300)])
    assert second[0] == first[1] and pool.num_used == 3  # b is one slot, held twice
    assert pool.view is not None
    offset, length = second[1]
    assert pool.view[offset: offset + length] == b"C" * 300
    pool.release("lease-1")
    assert pool.num_used == 2  # b stays: lease-2 holds it
    pool.release("lease-2")
    assert pool.num_used == 0


def test_a_pull_that_does_not_fit_takes_nothing(pool: ShmPool) -> None:
    pool.put("lease-1", [(_hash(i), b"x" * 10) for i in range(3)])
    with pytest.raises(KVPoolFullError, match="1 free slots, 2 wanted"):
        pool.put("lease-2", [(_hash(i), b"y" * 10) for i in range(3, 5)])
    assert pool.num_used == 3
    with pytest.raises(KVPoolFullError, match="not available"):
        pool.put("lease-3", [(_hash(9), b"z" * (PAGE + 1))])  # larger than a slot
    pool.release("lease-1")
    assert len(pool.put("lease-2", [(_hash(i), b"y" * 10) for i in range(3, 7)])) == 4


def test_a_pool_too_small_for_one_slot_is_never_used() -> None:
    pool = ShmPool.create(PAGE + 10)
    if pool is None:
        pytest.skip("no memfd_create on this platform")
    with pytest.raises(KVPoolFullError):
        pool.put("lease", [(_hash(0), b"x" * 100)])
    assert pool.is_broken
    pool.close()


READER = """
import json, sys
from strata.server.pd.shm import ShmPeers
described, offset, length = json.loads(sys.argv[1])
peers = ShmPeers()
pool = peers.attach(described)
print(json.dumps(None if pool is None else pool[offset: offset + length].decode()))
"""


def _read_elsewhere(described: dict[str, str], offset: int, length: int) -> str | None:
    out = subprocess.run([sys.executable, "-c", READER,
                          json.dumps([described, offset, length])],
                         capture_output=True, text=True, timeout=60, check=True)
    value: str | None = json.loads(out.stdout)
    return value


def test_another_process_maps_the_pool_only_with_its_token(pool: ShmPool) -> None:
    [(offset, length)] = pool.put("lease", [(_hash(1), b"kv bytes of block 1")])
    assert _read_elsewhere(pool.describe(), offset, length) == "kv bytes of block 1"
    forged = {**pool.describe(), "token": "0" * 32}
    assert _read_elsewhere(forged, offset, length) is None
    peers = ShmPeers()
    assert not peers.may_reach({"path": "/proc/0/fd/12345", "token": pool.token})
    assert not peers.may_reach("not a description")
    assert peers.attach(forged) is None and not peers.may_reach(forged)  # refused: not asked


# --- live instances ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def alone(tiny_model: LoadedModel) -> Instance:
    instance = start_instance(tiny_model, dtype="bfloat16")
    yield instance  # type: ignore[misc]
    instance.stop()


def test_a_handoff_on_one_host_reads_p_pool_and_answers_as_a_mixed_instance(
        tiny_model: LoadedModel, alone: Instance) -> None:
    p = start_instance(tiny_model, dtype="bfloat16")
    d = start_instance(tiny_model, dtype="bfloat16")
    engine = p.app.state.pd.instance.engine
    exported: list[object] = []  # whole payloads P exported: none (each goes into its slot)
    export_held = engine.export_held
    engine.export_held = lambda *args: exported.append(args) or export_held(*args)
    try:
        for n, sampling in enumerate([{"temperature": 0},
                                      {"temperature": 0.9, "seed": 5, "top_p": 0.9}]):
            body = body_of(LONG, n=300 + n, **sampling)
            handle = prefill(p, body)
            answer = decode(d, body, handle)
            assert answer.status_code == 200, answer.text
            assert comparable(answer.json()) == comparable(mixed(alone, body).json())
            num_blocks = json.loads(handle)["num_blocks"]
            assert d.engine.stats().num_external_hit_tokens >= (num_blocks - 1) * 8
        assert d.metric("pd_pulls_total", transport="shm") == 2
        assert d.metric("pd_pulls_total", transport="http") == 0
        assert exported == []  # the pool was sized by the layout, not by a sample export
        assert p.app.state.pd.shm.slot_bytes >= p.app.state.pd.layout["payload_bytes"] > 0
        assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") == 2
        shm = p.app.state.pd.shm
        assert wait_until(lambda: p.num_held_blocks == 0 and shm.num_used == 0)  # acked
    finally:
        p.stop()
        d.stop()


def test_a_full_pool_sends_d_to_the_stream(tiny_model: LoadedModel, alone: Instance) -> None:
    p = start_instance(tiny_model, dtype="bfloat16")
    d = start_instance(tiny_model, dtype="bfloat16")
    try:
        shm = p.app.state.pd.shm
        shm.capacity_bytes = 3 * PAGE  # at most two slots (a slot is a page at least): too few
        body = body_of(LONG, n=310, temperature=0)
        answer = decode(d, body, prefill(p, body))
        assert comparable(answer.json()) == comparable(mixed(alone, body).json())
        assert d.metric("pd_pulls_total", transport="http") == 1
        assert d.metric("pd_pulls_total", transport="shm") == 0  # asked, refused (409)
        assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") == 1
        assert wait_until(lambda: p.num_held_blocks == 0 and shm.num_used == 0)
    finally:
        p.stop()
        d.stop()



def test_a_one_token_handoff_leaves_its_prompt_in_ds_prefix_cache(tiny_model: LoadedModel,
                                                                   alone: Instance) -> None:
    """The imported blocks join D's prefix cache at the hand-over, though no step runs."""
    p = start_instance(tiny_model, dtype="bfloat16")
    d = start_instance(tiny_model, dtype="bfloat16")
    try:
        body = {**body_of(LONG, n=320, temperature=0), "max_tokens": 1}
        handle = prefill(p, body)
        assert decode(d, body, handle).status_code == 200
        again = mixed(d, body).json()
        num_full = json.loads(handle)["num_prompt_tokens"] // 8 * 8
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= num_full - 8
        assert comparable(again) == comparable(mixed(alone, body).json()) | {
            "usage": comparable(again)["usage"]}
    finally:
        p.stop()
        d.stop()


OWNER = """
import json, sys
from strata.server.pd.shm import ShmPool
from strata.types import BlockHash
pool = ShmPool.create(1 << 20)
[(offset, length)] = pool.put("lease", [(BlockHash(bytes(16)), b"held by a P that will die")])
print(json.dumps([pool.describe(), offset, length]), flush=True)
sys.stdin.readline()  # lives until told
"""


def test_the_pool_of_a_p_that_died_is_let_go() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdin is not None
        described, offset, length = json.loads(owner.stdout.readline())
        peers = ShmPeers()
        pool = peers.attach(described)
        assert pool is not None and pool[offset: offset + length] == b"held by a P that will die"
        assert peers.prune() == 0  # P is alive: kept
        owner.stdin.write("\n")
        owner.stdin.flush()
        owner.wait(timeout=30)
        assert peers.prune() == 1
        assert not peers.may_reach(described)  # its path is gone with it
    finally:
        owner.kill()
        owner.communicate(timeout=30)  # closes its pipes


def test_a_slot_is_stamped_with_its_block_and_unstamped_when_freed(pool: ShmPool) -> None:
    """D checks the stamp after its copy: a slot P freed and refilled meanwhile (its lease
    ended early) shows another block's hash, or none, never the one D asked for."""
    [(offset, _)] = pool.put("lease-1", [(_hash(1), b"block one")])
    assert pool.view is not None
    assert pool.view[offset - STAMP: offset - STAMP + 16] == _hash(1)
    pool.release("lease-1")
    assert pool.view[offset - STAMP: offset - STAMP + 16] == bytes(16)
    [(again, _)] = pool.put("lease-2", [(_hash(2), b"block two")])
    assert again == offset  # the same slot, now another block's
    assert pool.view[offset - STAMP: offset - STAMP + 16] == _hash(2)


def test_d_opens_only_another_process_descriptor(tmp_path: Path, pool: ShmPool) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    peers = ShmPeers()
    for path in (str(fifo), "/etc/passwd", "/proc/self/fd/0"):
        described = {"path": path, "token": pool.token}
        assert not peers.may_reach(described) and peers.attach(described) is None
