"""The instance's prefix-cache events for gateways: what its engine caches and evicts.

    GET /v1/strata/kv-events?epoch=E&after=S&wait_s=W     (prefix_routes.py)

A gateway polls with the cursor of the last answer (`epoch`, `after` = the last batch it
applied); the answer holds every batch after its cursor, or, when its cursor is of another epoch
(this process restarted), older than the batches kept, or absent, a snapshot of the whole cache
followed by nothing. A poll with nothing new waits up to `wait_s` (at most `MAX_WAIT_S`) and then
answers with no batch: the gateway's heartbeat.

Why a long poll and not an SSE stream: uvicorn's graceful shutdown waits for open responses, and
a stream that never ends would hold every drain for its full timeout; a poll ends within
`wait_s`. The instance keeps no state per gateway: batches go into one bounded ring that every
gateway reads from its own cursor, so N gateways cost N cheap reads, not N copies.

`epoch` is the process's start time (seconds since 1970, float): an instance that restarts under
the same id answers with a larger epoch, and the gateway drops what it knew of the old process.
The answer's wire format, and the `CacheIdentity` both sides share, are
strata/protocol/kv_events.py.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass

from strata.clock import Clock
from strata.engine.block_events import BlockChanges, BlockEventLog, watch_blocks
from strata.engine.engine import Engine
from strata.model.tokenizer import Tokenizer
from strata.protocol.kv_events import MAX_WAIT_S, CacheIdentity, EventBatch, EventsAnswer
from strata.server.async_engine import EngineCore
from strata.server.translate import ServerTokenizer

POLL_STEP_S = 0.02  # how often a waiting poll looks for new batches
DEFAULT_MAX_BATCHES = 256


class KVEventFeed:
    """A bounded ring of the engine's block batches, answered per gateway cursor."""

    def __init__(self, log: BlockEventLog, identity: CacheIdentity, *, epoch: float,
                 max_batches: int = DEFAULT_MAX_BATCHES) -> None:
        self.log = log
        self.identity = identity
        self.epoch = epoch
        self._batches: deque[BlockChanges] = deque(maxlen=max_batches)
        self._snapshot_seq = 0  # cursors before this missed an overflow: they get a snapshot
        self.num_polls = 0

    def refresh(self) -> None:
        """Moves the engine's pending changes into the ring."""
        changes = self.log.take()
        if changes is None:
            return
        if changes.is_snapshot:
            self._batches.clear()
            self._snapshot_seq = changes.seq
        else:
            self._batches.append(changes)

    def answer(self, epoch: float | None, after: int | None) -> EventsAnswer | None:
        """The answer for this cursor; None when it is up to date (nothing new yet)."""
        self.refresh()
        if epoch != self.epoch or after is None or not self._covers(after):
            return self._answer(self.log.snapshot(), [])
        news = [batch for batch in self._batches if batch.seq > after]
        return self._answer(None, news) if news else None

    def heartbeat(self, after: int) -> EventsAnswer:
        return self._answer(None, [], seq=after)

    def _covers(self, after: int) -> bool:
        oldest = self._batches[0].seq if self._batches else self.log.seq + 1
        return self._snapshot_seq <= after <= self.log.seq and after >= oldest - 1

    def _answer(self, snapshot: BlockChanges | None, batches: list[BlockChanges],
                seq: int | None = None) -> EventsAnswer:
        last = batches[-1].seq if batches else (snapshot.seq if snapshot else seq)
        assert last is not None
        return EventsAnswer(
            self.epoch, last, self.identity, self.log.num_dropped,
            [EventBatch(b.seq, b.stored, b.removed) for b in batches],
            None if snapshot is None else EventBatch(snapshot.seq, snapshot.stored))

    async def poll(self, epoch: float | None, after: int | None, wait_s: float,
                   clock: Clock = time.monotonic) -> EventsAnswer:
        """`answer`, waiting up to `wait_s` for news; a heartbeat when none came."""
        self.num_polls += 1
        deadline = clock() + min(max(wait_s, 0.0), MAX_WAIT_S)
        while True:
            answer = self.answer(epoch, after)
            if answer is not None:
                return answer
            if clock() >= deadline:
                return self.heartbeat(after if after is not None else self.log.seq)
            await asyncio.sleep(POLL_STEP_S)


def open_kv_events(engine: EngineCore, *, epoch: float | None = None) -> KVEventFeed | None:
    """The feed of `engine`'s prefix cache (None for an engine that is not Strata's own, e.g.
    a test double, or one without a prefix cache). Call before the first request reaches the
    engine."""
    if not isinstance(engine, Engine) or not engine.cache_config.enable_prefix_caching:
        return None
    config = engine.cache_config
    identity = CacheIdentity(config.block_size, config.namespace)
    return KVEventFeed(watch_blocks(engine.kv), identity,
                       epoch=time.time() if epoch is None else epoch)


class TokenizerSpec:
    """The tokenizer answer, computed on first use (serialising a 49k-token vocabulary takes
    tens of milliseconds: not at every start)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @functools.cached_property
    def _answer(self) -> tuple[str, bytes]:
        tk = self._tokenizer
        fields = {"tokenizer_json": tk.to_json(), "chat_template": tk.chat_template,
                  "bos_token": tk.bos_token, "eos_token": tk.eos_token}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
        return digest, json.dumps({"fingerprint": digest, **fields}).encode()

    @property
    def fingerprint(self) -> str:
        return self._answer[0]

    @property
    def body(self) -> bytes:
        return self._answer[1]


@dataclass(slots=True)
class PrefixServing:
    """An instance's side of cache-aware routing: its cache's feed and its tokenizer."""

    feed: KVEventFeed | None
    tokenizer: TokenizerSpec | None


def open_prefix_serving(engine: EngineCore, tokenizer: ServerTokenizer) -> PrefixServing:
    """Attach the feed to `engine`'s block pool; call before the first request reaches it."""
    spec = TokenizerSpec(tokenizer) if isinstance(tokenizer, Tokenizer) else None
    return PrefixServing(open_kv_events(engine), spec)


__all__ = ["KVEventFeed", "PrefixServing", "TokenizerSpec",
           "open_kv_events", "open_prefix_serving"]
