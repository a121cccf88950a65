"""Stories of the prefix index over an injected clock: events in order and out of order,
eviction, restarts (epochs), silence, routing history, bounded memory, and version namespacing
(another version's block hashes never match)."""

from __future__ import annotations

from strata.clock import ManualClock
from strata.gateway.routing.prefix.index import BlockBatch, IndexConfig, PrefixIndex
from strata.gateway.routing.prefix.prompt import Prompt, id_keys
from strata.types import hash_blocks


def keys(*names: str) -> list[bytes]:
    return [name.encode().ljust(16, b".") for name in names]


A, B, C, D = keys("a", "b", "c", "d")


def index(**config: float) -> tuple[PrefixIndex, ManualClock]:
    clock = ManualClock(100.0)
    return PrefixIndex(IndexConfig(**config), clock), clock  # type: ignore[arg-type]


def test_events_in_order_build_the_instance_cache_and_eviction_cuts_the_match() -> None:
    idx, _ = index()
    assert idx.apply("i1", BlockBatch(1.0, 1, [A, B], is_snapshot=True))
    assert idx.apply("i1", BlockBatch(1.0, 2, [C]))
    assert idx.match("i1", [A, B, C, D]) == 3
    assert idx.apply("i1", BlockBatch(1.0, 3, [], [B]))
    assert idx.match("i1", [A, B, C, D]) == 1  # a prefix match stops at the first missing block
    assert idx.match("i2", [A]) == 0


def test_a_late_batch_never_undoes_a_newer_change() -> None:
    idx, _ = index()
    idx.apply("i1", BlockBatch(1.0, 1, [A], is_snapshot=True))
    idx.apply("i1", BlockBatch(1.0, 3, [], [B]))  # seq 3 (B evicted) arrives first
    idx.apply("i1", BlockBatch(1.0, 2, [B, C]))  # seq 2 (B, C stored) arrives late
    assert idx.match("i1", [A, C]) == 2
    assert idx.match("i1", [A, B]) == 1  # B's eviction at 3 stands
    idx.apply("i1", BlockBatch(1.0, 5, [], [C]))
    idx.apply("i1", BlockBatch(1.0, 4, [C]))  # stored at 4, evicted at 5: stays evicted
    assert idx.match("i1", [A, C]) == 1


def test_a_snapshot_replaces_the_blocks_keeps_newer_changes_and_sets_a_floor() -> None:
    idx, _ = index()
    idx.apply("i1", BlockBatch(1.0, 1, [A, B], is_snapshot=True))
    idx.apply("i1", BlockBatch(1.0, 7, [D]))  # newer than the snapshot below
    assert idx.apply("i1", BlockBatch(1.0, 6, [C], is_snapshot=True))
    assert idx.match("i1", [C, D]) == 2 and idx.match("i1", [A]) == 0
    assert not idx.apply("i1", BlockBatch(1.0, 5, [A]))  # below the floor: ignored
    assert idx.match("i1", [A]) == 0 and idx.num_ignored == 1


def test_a_restart_drops_the_old_process_entries_and_its_late_batches() -> None:
    idx, _ = index()
    idx.apply("i1", BlockBatch(1.0, 1, [A, B], is_snapshot=True))
    idx.learn("i1", [D])
    assert idx.apply("i1", BlockBatch(2.0, 1, [C], is_snapshot=True))  # new epoch: restarted
    assert idx.match("i1", [A]) == 0 and idx.match("i1", [D]) == 0 and idx.match("i1", [C]) == 1
    assert not idx.apply("i1", BlockBatch(1.0, 9, [A]))  # the old process, late: ignored
    assert idx.match("i1", [A]) == 0


def test_a_silent_instance_is_ignored_after_one_second_and_then_forgotten() -> None:
    idx, clock = index(stale_after_s=1.0)
    idx.apply("i1", BlockBatch(1.0, 1, [A], is_snapshot=True))
    idx.apply("i2", BlockBatch(1.0, 1, [A], is_snapshot=True))
    clock.advance(0.6)
    idx.heard("i2", 1.0)  # i2's heartbeat; i1 says nothing
    idx.heard("i2", 0.5)  # a heartbeat of another process does not count
    clock.advance(0.5)
    assert idx.match("i1", [A]) == 0 and not idx.is_reporting("i1")  # 1.1 s of silence
    assert idx.match("i2", [A]) == 1
    assert idx.expire() == ["i1"]
    assert idx.num_blocks("i1") == 0 and idx.num_blocks("i2") == 1


def test_forget_drops_everything_at_once() -> None:
    idx, _ = index()
    idx.apply("i1", BlockBatch(1.0, 1, [A], is_snapshot=True))
    idx.learn("i1", [B])
    idx.forget("i1")
    assert idx.match("i1", [A]) == 0 and idx.match("i1", [B]) == 0 and idx.instances() == []


def test_routed_keys_count_briefly_beside_events_and_long_without_them() -> None:
    idx, clock = index(expect_ttl_s=2.0, routed_ttl_s=60.0, stale_after_s=1.0)
    idx.apply("events", BlockBatch(1.0, 1, [], is_snapshot=True))
    idx.learn("events", [A, B])
    idx.learn("silent", [A, B])  # an instance that publishes nothing
    assert idx.match("events", [A, B, C]) == 2 and idx.match("silent", [A, B, C]) == 2
    clock.advance(0.9)
    idx.heard("events", 1.0)
    idx.apply("events", BlockBatch(1.0, 2, [A]))  # the events confirm A only
    clock.advance(1.5)  # 2.4 s after routing
    idx.heard("events", 1.0)
    assert idx.match("events", [A, B]) == 1  # B was never confirmed: its guess expired
    assert idx.match("silent", [A, B]) == 2
    clock.advance(60)
    assert idx.match("silent", [A, B]) == 0


def test_memory_is_bounded_least_recently_stored_first() -> None:
    idx, _ = index(max_blocks=2, max_routed=2)
    idx.apply("i1", BlockBatch(1.0, 1, [A, B], is_snapshot=True))
    idx.apply("i1", BlockBatch(1.0, 2, [C]))
    assert idx.num_blocks("i1") == 2 and idx.match("i1", [B, C]) == 2 and idx.match("i1", [A]) == 0
    idx.learn("i2", [A, B, C])
    assert idx.num_keys("i2") == 2 and idx.match("i2", [B, C]) == 2


def test_another_version_never_matches() -> None:
    idx, _ = index()
    prompt = Prompt(token_ids=list(range(64)))
    v1 = id_keys(prompt, 16, "model@v1").keys
    v2 = id_keys(prompt, 16, "model@v2").keys
    assert v1 == tuple(hash_blocks(list(range(64)), 16, "model@v1|"))  # the engine's own hashes
    idx.apply("old", BlockBatch(1.0, 1, list(v1), is_snapshot=True))
    assert idx.match("old", v1) == 4
    assert idx.match("old", v2) == 0
    salted = id_keys(Prompt(token_ids=list(range(64)), cache_salt="tenant-b"), 16, "model@v1")
    assert idx.match("old", salted.keys) == 0
