"""The hand-off's parts alone: the handle and the block stream, the lease table on a fake
clock, the fault config, the layout comparison."""

from __future__ import annotations

import argparse
import asyncio
import json
import zlib
from pathlib import Path

import pytest

from strata.engine.outputs import HeldBlocks
from strata.errors import ConfigError, InvalidRequestError, KVPayloadError
from strata.registry import create_registry
from strata.registry.instances.records import InstanceRecord
from strata.server.pd.faults import FaultConfig, Faults
from strata.server.pd.layout import differences, explain
from strata.server.pd.leases import LeaseTable
from strata.server.pd.trust import HandleTrust
from strata.server.pd.wire import (
    BlockReader,
    Handle,
    block_frame,
    checksum_ok,
    prompt_digest,
    stream_head,
)
from strata.types import BlockHash, RequestId


def payload(body: bytes) -> bytes:
    return body + zlib.crc32(body).to_bytes(4, "little")


HASHES = [BlockHash(bytes([i]) * 16) for i in range(3)]
STREAM = stream_head(3) + b"".join(block_frame(h, payload(bytes([i]) * 40))
                                   for i, h in enumerate(HASHES))


def test_the_block_stream_parses_whatever_the_chunking() -> None:
    for size in (1, 7, 64, len(STREAM)):
        reader = BlockReader()
        blocks = [b for i in range(0, len(STREAM), size)
                  for b in reader.feed(STREAM[i : i + size])]
        assert [h for h, _ in blocks] == HASHES and reader.is_complete
        assert all(checksum_ok(p) for _, p in blocks)


def test_a_truncated_stream_yields_only_whole_blocks() -> None:
    reader = BlockReader()
    blocks = list(reader.feed(STREAM[:-5]))
    assert len(blocks) == 2 and not reader.is_complete


def test_a_foreign_stream_is_refused() -> None:
    with pytest.raises(KVPayloadError, match="not a Strata block stream"):
        list(BlockReader().feed(b"HTTP/1.1 200 OK\r\n\r\n"))
    with pytest.raises(KVPayloadError, match="over the limit"):
        list(BlockReader(max_block_bytes=10).feed(STREAM))


def test_checksum_catches_one_flipped_bit() -> None:
    good = payload(b"kv" * 50)
    bad = bytearray(good)
    bad[10] ^= 1
    assert checksum_ok(good) and not checksum_ok(bytes(bad)) and not checksum_ok(b"ab")


def test_the_handle_round_trips_and_needs_a_url() -> None:
    handle = Handle("h", "e", 20, prompt_digest([1, 2], "m@1", ""), 3, 7, 8, 10.0, -0.5,
                    [(7, -0.5), (2, -1.5)], "http://127.0.0.1:1")
    assert Handle.from_json(handle.to_json()) == handle
    assert handle.first_logprob is not None and handle.first_logprob.top == [(7, -0.5),
                                                                              (2, -1.5)]
    no_url = Handle("h", "e", 20, "d", 3, 7, 8, 10.0)
    with pytest.raises(InvalidRequestError, match="URL"):
        Handle.from_json(no_url.to_json())
    with pytest.raises(InvalidRequestError, match="malformed"):
        Handle.from_json('{"handle": "h"}')


def test_the_prompt_digest_names_tokens_model_salt_and_adapter() -> None:
    base = prompt_digest([1, 2, 3], "m@1", "")
    assert base == prompt_digest([1, 2, 3], "m@1", "") == prompt_digest([1, 2, 3], "m@1", "", "")
    assert len({base, prompt_digest([1, 2, 4], "m@1", ""), prompt_digest([1, 2, 3], "m@2", ""),
                prompt_digest([1, 2, 3], "m@1", "s"), prompt_digest([1, 2, 3], "m@1", "", "d1"),
                prompt_digest([1, 2, 3], "m@1", "", "d2")}) == 6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(clock: Clock, unpulled_s: float = 10.0) -> tuple[LeaseTable, list[RequestId], list[str]]:
    released: list[RequestId] = []
    reasons: list[str] = []
    leases = LeaseTable(released.append, lease_s=10, broken_grace_s=2, unpulled_s=unpulled_s,
                        clock=clock, on_release=lambda lease: reasons.append(lease.why))
    return leases, released, reasons


HELD = HeldBlocks((4, 5, 6), tuple(HASHES))


def test_a_lease_ends_once_acked_or_expired() -> None:
    clock = Clock()
    leases, released, reasons = table(clock)
    a = leases.grant(RequestId("a"), HELD)
    b = leases.grant(RequestId("b"), HELD)
    assert leases.num_held_blocks == 6
    assert leases.ack(a.handle) and not leases.ack(a.handle)
    pull = leases.begin_pull(b.handle)  # pulled (completely), never acknowledged
    assert pull is not None
    leases.end_pull(pull, is_complete=True)
    clock.now += 9.9
    assert leases.expire() == 0
    clock.now += 0.1
    assert leases.expire() == 3 and leases.expire() == 0
    assert released == ["a", "b"] and reasons == ["acked", "expired"]
    assert leases.begin_pull(b.handle) is None and len(leases) == 0


def test_a_handle_nobody_pulls_is_released_after_the_unpulled_grace() -> None:
    """A decode instance that died before it pulled: its blocks are back within the grace,
    not the whole lease; a pull begun in time gets the whole lease."""
    clock = Clock()
    leases, released, reasons = table(clock, unpulled_s=2.0)
    idle = leases.grant(RequestId("idle"), HELD)
    pulled = leases.grant(RequestId("pulled"), HELD)
    clock.now += 1.9
    lease = leases.begin_pull(pulled.handle)
    assert lease is not None
    leases.end_pull(lease, is_complete=True)
    clock.now += 0.1
    assert leases.expire() == 3 and released == ["idle"] and reasons == ["unpulled"]
    assert leases.begin_pull(idle.handle) is None  # a D that comes later recomputes
    clock.now += 7.9  # 9.9 s after the grant: the pulled one is held for its whole lease
    assert leases.expire() == 0
    clock.now += 0.1
    assert leases.expire() == 3 and reasons == ["unpulled", "expired"]


def test_blocks_are_never_released_while_a_pull_reads_them() -> None:
    clock = Clock()
    leases, released, reasons = table(clock)
    lease = leases.grant(RequestId("a"), HELD)
    assert leases.begin_pull(lease.handle) is lease
    leases.ack(lease.handle)
    clock.now += 60
    assert leases.expire() == 0 and released == []
    assert leases.begin_pull(lease.handle) is None  # no new pull once acknowledged
    leases.end_pull(lease, is_complete=True)
    assert released == ["a"] and reasons == ["acked"]


def test_a_broken_pull_shrinks_the_lease_to_the_grace_for_a_second_pull() -> None:
    clock = Clock()
    leases, released, reasons = table(clock)
    lease = leases.grant(RequestId("a"), HELD)
    leases.begin_pull(lease.handle)
    leases.end_pull(lease, is_complete=False)  # D died mid-pull
    assert released == []
    again = leases.begin_pull(lease.handle)  # another D, within the grace
    assert again is lease
    leases.end_pull(lease, is_complete=False)
    clock.now += 2.0
    leases.expire()
    assert released == ["a"] and reasons == ["broken"]


def test_release_all_ends_every_lease() -> None:
    leases, released, reasons = table(Clock())
    lease = leases.grant(RequestId("a"), HELD)
    leases.begin_pull(lease.handle)
    leases.release_all()
    assert released == ["a"] and reasons == ["shutdown"] and leases.num_held_blocks == 0


def test_fault_config_names_kill_points(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown kill point 'nowhere'; valid: "):
        FaultConfig(kill_at="nowhere")
    file = tmp_path / "faults.json"
    file.write_text('{"kill_at": "decode_after_pull", "after": 1}')
    kills: list[str] = []
    faults = Faults(FaultConfig.load(file), kill=lambda: kills.append("killed"))
    faults.reached("decode_before_pull")
    faults.reached("decode_after_pull")
    assert kills == []
    faults.reached("decode_after_pull")
    assert kills == ["killed"]
    file.write_text('{"kill": "x"}')
    with pytest.raises(ConfigError, match="expected an object with keys among"):
        FaultConfig.load(file)


def test_a_share_fault_is_armed_by_a_run_in_the_prompt_on_its_rank_only(
        tmp_path: Path) -> None:
    from strata.commands.serve_parallel import _share_faults
    from strata.engine.executor import ModelInput, ScheduledSequence
    from strata.engine.request import SamplingParams

    file = tmp_path / "faults.json"
    file.write_text('{"share_fault": {"rank": 0, "prompt_run": [5, 6, 5]}}')
    (fault,) = _share_faults(argparse.Namespace(fault_config=str(file)))

    def step(prompt: list[int]) -> ModelInput:  # a decode step: its token is not the run
        sequence = ScheduledSequence(RequestId("r"), [9], len(prompt), [0], True,
                                     SamplingParams(), [9], prompt)
        return ModelInput([sequence], block_size=8)

    assert fault.is_armed(0, step([1, 5, 6, 5, 2]))
    assert not fault.is_armed(1, step([1, 5, 6, 5, 2]))  # another rank
    assert not fault.is_armed(0, step([5, 6, 2, 5]))  # the ids, not the run
    file.write_text('{"share_fault": {"token_id": 3}}')
    with pytest.raises(ConfigError, match="share_fault wants an object with rank"):
        FaultConfig.load(file)
    file.write_text('{"share_fault": {"rank": 1, "prompt_run": [5, 6]}}')
    with pytest.raises(ConfigError, match="rank 0 only"):
        _share_faults(argparse.Namespace(fault_config=str(file)))


def test_damage_flips_a_payload_byte_or_the_hash() -> None:
    faults = Faults(FaultConfig(corrupt_block=1, corrupt_hash_block=2))
    body = payload(b"x" * 20)
    assert faults.damage(0, HASHES[0], body) == (HASHES[0], body)
    block_hash, damaged = faults.damage(1, HASHES[1], body)
    assert block_hash == HASHES[1] and not checksum_ok(damaged)
    block_hash, same = faults.damage(2, HASHES[2], body)
    assert block_hash != HASHES[2] and same == body


def test_layouts_differ_by_named_fields_in_order() -> None:
    local = {"format": 1, "model": "m", "version": "v1", "dtype": "float32", "block_size": 16}
    peer = {**local, "dtype": "bfloat16", "version": "v2"}
    assert differences(local, local) == []
    fields = differences(local, peer)
    assert fields == ["version", "dtype"]
    assert explain(local, peer, fields) == ("version: 'v1' here, 'v2' at the peer, "
                                            "dtype: 'float32' here, 'bfloat16' at the peer")


def test_without_a_key_only_an_instance_the_registry_lists_is_pulled_from() -> None:
    handle = {"handle": "h", "epoch": "e", "num_prompt_tokens": 20, "prompt_digest": "d",
              "num_blocks": 3, "token_id": 7, "num_cached_tokens": 0, "lease_s": 10.0}

    async def story() -> None:
        registry = create_registry("memory://")
        await registry.register(InstanceRecord("p-0", "http://10.0.0.5:8000", "m"))
        trust = HandleTrust((), registry)
        listed = await trust.admit(json.dumps(handle | {"instance_id": "p-0",
                                                        "url": "http://attacker:80"}))
        assert listed.url == "http://10.0.0.5:8000"  # the registry's, never the handle's
        with pytest.raises(InvalidRequestError, match="does not list"):
            await trust.admit(json.dumps(handle | {"instance_id": "p-9",
                                                   "url": "http://10.0.0.5:8000"}))
        with pytest.raises(InvalidRequestError, match="internal key .* or a registry"):
            await HandleTrust((), None).admit(json.dumps(handle | {"url": "http://p:1"}))
        await registry.close()

    asyncio.run(story())
