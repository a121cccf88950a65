"""Which prompt blocks each instance holds: the index of `--policy cache_aware`.

A key is a block hash of the engine's own chain (strata/types.py; model version and cache salt
in its namespace, so another version's blocks never match), or, for an instance whose cache
identity or tokenizer the gateway does not know, a hash of a fixed-size chunk of prompt text
(prefix_index_prompt.py). Two sources per instance:

- reported: what the instance says it caches and evicts (GET /v1/strata/kv-events, polled by
  prefix_index_feed.py) — exact;
- routed: the keys of prompts this gateway sent there (`learn`) — an instant guess. It counts for
  `expect_ttl_s` while the instance reports (its events confirm or correct it by then), and for
  `routed_ttl_s` when it does not (the fallback: an approximate index of routing history).

Reported batches carry (epoch, seq): the instance process's start time and the batch number.

    epoch older than known      ignored (a batch from before a restart)
    epoch newer than known      everything known of that instance is dropped, then applied
    seq <= floor                ignored (a snapshot at `floor` superseded it)
    snapshot at S               the blocks become the snapshot, except changes newer than S
    delta at S, per hash        last writer wins by seq: a batch that arrives late never undoes
                                a newer change (an eviction leaves a tombstone for that)

An instance not heard from for `stale_after_s` (its poll answers at least every 0.5 s) has its
reported blocks ignored at once and dropped by the next `expire`; the feed drops them as soon as
a poll fails (`forget`). Memory is bounded: per instance at most `max_blocks` reported hashes and
as many tombstones (least recently stored dropped first) and `max_routed` routed keys.

Pure bookkeeping over an injected clock: no I/O, so a virtual-clock simulator can drive it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from strata.clock import Clock

Key = bytes


@dataclass(frozen=True, slots=True)
class BlockBatch:
    """One reported batch (see the module docstring); a snapshot's `stored` is the whole cache."""

    epoch: float
    seq: int
    stored: Sequence[Key] = ()
    removed: Sequence[Key] = ()
    is_snapshot: bool = False


@dataclass(slots=True)
class _Reported:
    epoch: float
    heard_at: float
    floor: int = 0
    blocks: OrderedDict[Key, int] = field(default_factory=OrderedDict)  # hash -> seq stored
    tombstones: OrderedDict[Key, int] = field(default_factory=OrderedDict)  # -> seq evicted


@dataclass(frozen=True, slots=True)
class IndexConfig:
    stale_after_s: float = 1.0
    expect_ttl_s: float = 2.0
    routed_ttl_s: float = 120.0
    max_blocks: int = 65_536
    max_routed: int = 16_384


class PrefixIndex:
    """Per instance: reported blocks and routed keys (see the module docstring)."""

    def __init__(self, config: IndexConfig | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.config = config or IndexConfig()
        self.clock = clock
        self._reported: dict[str, _Reported] = {}
        self._routed: dict[str, OrderedDict[Key, float]] = {}
        self.num_ignored = 0  # batches from an older epoch or below a snapshot's floor

    # --- reported -----------------------------------------------------------------------------

    def apply(self, instance_id: str, batch: BlockBatch) -> bool:
        """Applies one reported batch; False when it was ignored (stale epoch or seq)."""
        now = self.clock()
        entry = self._reported.get(instance_id)
        if entry is not None and batch.epoch < entry.epoch:
            self.num_ignored += 1
            return False
        if entry is None or batch.epoch > entry.epoch:
            if entry is not None:  # a restart: what was routed to the old process is gone too
                self._routed.pop(instance_id, None)
            entry = self._reported[instance_id] = _Reported(batch.epoch, now)
        entry.heard_at = now
        if batch.seq <= entry.floor:
            self.num_ignored += 1
            return False
        if batch.is_snapshot:
            _replace(entry, batch)
        else:
            _merge(entry, batch)
        self._trim(entry)
        return True

    def heard(self, instance_id: str, epoch: float) -> None:
        """A heartbeat: the instance (process `epoch`) answered with nothing new."""
        entry = self._reported.get(instance_id)
        if entry is not None and entry.epoch == epoch:
            entry.heard_at = self.clock()

    def forget(self, instance_id: str) -> None:
        """Drops everything known of the instance (it left, or its feed failed)."""
        self._reported.pop(instance_id, None)
        self._routed.pop(instance_id, None)

    def expire(self) -> list[str]:
        """Forgets the reported blocks of instances silent for `stale_after_s`; their ids."""
        now = self.clock()
        gone = [iid for iid, entry in self._reported.items()
                if now - entry.heard_at > self.config.stale_after_s]
        for instance_id in gone:
            del self._reported[instance_id]
        return gone

    def is_reporting(self, instance_id: str) -> bool:
        entry = self._reported.get(instance_id)
        return entry is not None and self.clock() - entry.heard_at <= self.config.stale_after_s

    def num_blocks(self, instance_id: str) -> int:
        """Reported blocks the instance holds."""
        entry = self._reported.get(instance_id)
        return len(entry.blocks) if entry is not None else 0

    def num_keys(self, instance_id: str) -> int:
        """Reported blocks and routed keys: how much of the cache is spoken for."""
        return self.num_blocks(instance_id) + len(self._routed.get(instance_id, ()))

    # --- routed and matching ------------------------------------------------------------------

    def learn(self, instance_id: str, keys: Sequence[Key]) -> None:
        """Records that a prompt with `keys` was sent to the instance."""
        routed = self._routed.setdefault(instance_id, OrderedDict())
        now = self.clock()
        for key in keys:
            routed[key] = now
            routed.move_to_end(key)
        while len(routed) > self.config.max_routed:
            routed.popitem(last=False)

    def match(self, instance_id: str, keys: Sequence[Key]) -> int:
        """How many leading `keys` the instance holds (reported, or routed within its TTL)."""
        now = self.clock()
        entry = self._reported.get(instance_id)
        if entry is not None and now - entry.heard_at > self.config.stale_after_s:
            entry = None
        blocks: dict[Key, int] | OrderedDict[Key, int] = entry.blocks if entry else {}
        routed: dict[Key, float] | OrderedDict[Key, float] = self._routed.get(instance_id, {})
        ttl_s = self.config.expect_ttl_s if entry is not None else self.config.routed_ttl_s
        num = 0
        for key in keys:
            if key not in blocks:
                routed_at = routed.get(key)
                if routed_at is None or now - routed_at > ttl_s:
                    break
            num += 1
        return num

    def instances(self) -> list[str]:
        return sorted(set(self._reported) | set(self._routed))

    def _trim(self, entry: _Reported) -> None:
        limit = self.config.max_blocks
        while len(entry.blocks) > limit:
            entry.blocks.popitem(last=False)
        while len(entry.tombstones) > limit:
            entry.tombstones.popitem(last=False)


def _replace(entry: _Reported, batch: BlockBatch) -> None:
    """The snapshot at seq S becomes the blocks; changes newer than S (applied out of order,
    before the snapshot arrived) stay."""
    seq = batch.seq
    newer = [(key, stored) for key, stored in entry.blocks.items() if stored > seq]
    tombstones = OrderedDict((key, gone) for key, gone in entry.tombstones.items() if gone > seq)
    blocks: OrderedDict[Key, int] = OrderedDict(
        (key, seq) for key in batch.stored if key not in tombstones)
    for key, stored in newer:
        blocks[key] = stored
        blocks.move_to_end(key)
    entry.blocks, entry.tombstones, entry.floor = blocks, tombstones, seq


def _merge(entry: _Reported, batch: BlockBatch) -> None:
    """A delta: per hash, the change with the higher seq wins."""
    seq, blocks, tombstones = batch.seq, entry.blocks, entry.tombstones
    for key in batch.removed:
        if blocks.get(key, -1) > seq or tombstones.get(key, -1) > seq:
            continue
        blocks.pop(key, None)
        tombstones[key] = seq
        tombstones.move_to_end(key)
    for key in batch.stored:
        if blocks.get(key, -1) > seq or tombstones.get(key, -1) > seq:
            continue
        blocks[key] = seq
        blocks.move_to_end(key)
        tombstones.pop(key, None)


__all__ = ["BlockBatch", "IndexConfig", "Key", "PrefixIndex"]
