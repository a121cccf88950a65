"""What an instance and a cache-aware gateway agree on about the instance's prefix cache.

    GET /v1/strata/kv-events?epoch=E&after=S&wait_s=W   the cache's changes since a cursor
    GET /v1/strata/tokenizer                              the tokenizer, versioned by fingerprint

An answer to kv-events (`EventsAnswer`, JSON):

    {"epoch": 1733350000.25,            the process's start time: a restart changes it
     "seq": 42,                          the cursor to send back as `after`
     "block_size": 16, "namespace": "m@v1", "tokenizer": "3f2a..." | null,   CacheIdentity
     "num_dropped": 0,                   changes the engine could not report (ring overflow)
     "batches": [{"seq": 41, "stored": HEX, "removed": HEX}, ...],
     "snapshot": {"seq": 40, "stored": HEX}}      only when the cursor was not usable

HEX is every block hash of the list, 16 bytes each, as one hex string. A poll with nothing new
waits up to `wait_s` (at most MAX_WAIT_S) and answers no batch and no snapshot: the heartbeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EVENTS_PATH = "/v1/strata/kv-events"
TOKENIZER_PATH = "/v1/strata/tokenizer"
MAX_WAIT_S = 5.0
HASH_BYTES = 16


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """How an instance names its blocks: with the same tokenizer (its fingerprint), block size
    and namespace (model name and version; a request's cache salt is appended as `|salt`), a
    gateway computes the same block hashes as the instance's engine."""

    block_size: int
    namespace: str
    tokenizer: str | None = None  # the fingerprint of GET /v1/strata/tokenizer's answer


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Blocks stored and removed by one engine step (a snapshot: every block now stored)."""

    seq: int
    stored: Sequence[bytes] = ()
    removed: Sequence[bytes] = ()


@dataclass(frozen=True, slots=True)
class EventsAnswer:
    """One kv-events answer (the module docstring draws it)."""

    epoch: float
    seq: int
    identity: CacheIdentity
    num_dropped: int = 0
    batches: Sequence[EventBatch] = ()
    snapshot: EventBatch | None = None

    @property
    def has_news(self) -> bool:
        return self.snapshot is not None or bool(self.batches)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "epoch": self.epoch, "seq": self.seq, "block_size": self.identity.block_size,
            "namespace": self.identity.namespace, "tokenizer": self.identity.tokenizer,
            "num_dropped": self.num_dropped,
            "batches": [{"seq": b.seq, "stored": hex_of(b.stored), "removed": hex_of(b.removed)}
                        for b in self.batches]}
        if self.snapshot is not None:
            body["snapshot"] = {"seq": self.snapshot.seq, "stored": hex_of(self.snapshot.stored)}
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> EventsAnswer:
        """The answer; KeyError, ValueError or TypeError when `body` is not one."""
        tokenizer = body.get("tokenizer")
        identity = CacheIdentity(int(body["block_size"]), str(body["namespace"]),
                                 None if tokenizer is None else str(tokenizer))
        snapshot = body.get("snapshot")
        return cls(float(body["epoch"]), int(body["seq"]), identity,
                   int(body.get("num_dropped", 0)),
                   [EventBatch(int(b["seq"]), hashes_of(b["stored"]), hashes_of(b["removed"]))
                    for b in body.get("batches") or []],
                   None if snapshot is None else EventBatch(int(snapshot["seq"]),
                                                            hashes_of(snapshot["stored"])))


def hex_of(hashes: Sequence[bytes]) -> str:
    return b"".join(hashes).hex()


def hashes_of(hex_text: str) -> list[bytes]:
    raw = bytes.fromhex(hex_text)
    if len(raw) % HASH_BYTES:
        raise ValueError(f"block hashes are {HASH_BYTES} bytes each; got {len(raw)} bytes")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


__all__ = ["EVENTS_PATH", "HASH_BYTES", "MAX_WAIT_S", "TOKENIZER_PATH", "CacheIdentity",
           "EventBatch", "EventsAnswer", "hashes_of", "hex_of"]
