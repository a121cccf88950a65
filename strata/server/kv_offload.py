"""KV offload: fetch a prompt's missing KV blocks from the KV store before the engine sees the
request, and publish finished requests' blocks to it in the background.

Per distinct prompt of an HTTP request (`prepare`):
1. hash its full blocks as the engine does (model, version, cache salt: one identity everywhere);
2. ask the engine how many leading blocks its prefix cache holds (a hint) and the store how many
   it holds (one round trip, no payload);
3. if the store has more and the prompt has at least `min_fetch_tokens` tokens, fetch the blocks
   after the local hit and attach them (`Request.external_kv`); the engine imports them when it
   admits the request and checks each against the loaded model (a refused block is recomputed);
4. flag the request for export from the first block the store lacks, so a turn publishes only
   what is new.
A store that is down costs a logged warning and a counted error: the prompt is recomputed. The
final output's blocks are written by a background task (`publish`): the response never waits for
the store and a failed write never fails the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from strata.engine.outputs import RequestOutput
from strata.engine.request import Request
from strata.errors import ConfigError, KVStoreUnavailableError
from strata.server.async_engine import EngineCore
from strata.server.config import ServerConfig
from strata.server.metrics import KVOffloadMetrics
from strata.state.kv_store import KVItem, KVStore, create_kv_store
from strata.types import BlockHash, KVPayload

log = logging.getLogger("strata.server.kv")
MAX_PENDING_PUBLISHES = 64  # beyond this a publish is dropped (counted), not queued


@dataclass(slots=True)
class _Plan:
    external_kv: dict[BlockHash, KVPayload] = field(default_factory=dict)
    export_start_block: int = 0


class KVOffload:
    """Fetch and publish for one server (see the module docstring)."""

    def __init__(self, store: KVStore, engine: EngineCore, metrics: KVOffloadMetrics,
                 model_name: str, *, min_fetch_tokens: int) -> None:
        self.store = store
        self.engine = engine
        self.metrics = metrics
        self.model_name = model_name
        self.min_fetch_tokens = min_fetch_tokens
        self._pending: set[asyncio.Task[None]] = set()

    async def prepare(self, requests: list[Request]) -> None:
        """Attach fetched KV to each request; the first request of each prompt exports."""
        plans: dict[tuple[str, int, tuple[int, ...]], _Plan] = {}
        for request in requests:
            key = (request.cache_salt, request.num_public_tokens,
                   tuple(request.prompt_token_ids))
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = await self._plan(request)
                request.kv_export = True
                request.kv_export_start_block = plan.export_start_block
            request.external_kv = plan.external_kv

    async def _plan(self, request: Request) -> _Plan:
        hashes = self.engine.block_hashes(request.prompt_token_ids, request.cache_salt,
                                          request.num_public_tokens,
                                          lora_digest=request.lora_digest)
        if not hashes:
            return _Plan()
        num_local = self.engine.num_cached_blocks(hashes)
        try:
            num_stored = await self.store.count_prefix(hashes)
            if num_stored <= num_local or request.num_prompt_tokens < self.min_fetch_tokens:
                return _Plan(export_start_block=num_stored)
            return await self._fetch(hashes[num_local:num_stored], num_local)
        except KVStoreUnavailableError as exc:
            log.warning("KV fetch skipped (prompt recomputed): %s", exc)
            self.metrics.fetch_errors.labels(self.model_name).inc()
            return _Plan()

    async def _fetch(self, hashes: list[BlockHash], num_local: int) -> _Plan:
        started = time.perf_counter()
        payloads = await self.store.get_prefix(hashes)
        m, model = self.metrics, self.model_name
        m.fetch_s.labels(model).observe(time.perf_counter() - started)
        m.fetched_blocks.labels(model).inc(len(payloads))
        m.fetched_bytes.labels(model).inc(sum(len(p) for p in payloads))
        return _Plan(dict(zip(hashes, payloads, strict=False)), num_local + len(payloads))

    def publish(self, blocks: list[KVItem]) -> None:
        """Write `blocks` in the background (never awaited by the response)."""
        if not blocks:
            return
        if len(self._pending) >= MAX_PENDING_PUBLISHES:
            log.warning("KV publish dropped: %d writes already pending", len(self._pending))
            self.metrics.publish_errors.labels(self.model_name).inc()
            return
        task = asyncio.create_task(self._put(blocks))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _put(self, blocks: list[KVItem]) -> None:
        try:
            num_stored = await self.store.put_many(blocks)
        except Exception as exc:  # the store's trouble is never the request's
            log.warning("KV publish failed: %s", exc)
            self.metrics.publish_errors.labels(self.model_name).inc()
            return
        stored = blocks[:num_stored]
        self.metrics.published_blocks.labels(self.model_name).inc(num_stored)
        self.metrics.published_bytes.labels(self.model_name).inc(sum(len(p) for _, p in stored))

    async def close(self, timeout_s: float) -> None:
        """Let pending writes finish (up to `timeout_s`), then close the store."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)
        await self.store.close()


async def publishing(outputs: AsyncGenerator[RequestOutput, None], offload: KVOffload
                     ) -> AsyncGenerator[RequestOutput, None]:
    """Pass `outputs` through, handing the final output's KV blocks to `offload.publish`."""
    try:
        async for output in outputs:
            if output.kv_blocks:
                offload.publish(output.kv_blocks)
                output.kv_blocks = []
            yield output
    finally:
        await outputs.aclose()


def open_kv_offload(config: ServerConfig, engine: EngineCore, metrics: KVOffloadMetrics,
                    store: KVStore | None = None) -> KVOffload | None:
    """KV offload over `store`, else over the store `config.kv_store_url` names; None when
    `config.kv_offload` is off."""
    if not config.kv_offload:
        return None
    check_namespace(engine, config.served_model_name, config.model_version)
    if store is None:
        assert config.kv_store_url is not None  # ServerConfig checks it
        store = create_kv_store(config.kv_store_url, limits=config.kv_limits())
    return KVOffload(store, engine, metrics, config.served_model_name,
                     min_fetch_tokens=config.kv_min_fetch_tokens)


def check_namespace(engine: EngineCore, model_name: str, model_version: str) -> None:
    """Blocks are shared by hash, so the engine's hash namespace must name what is served:
    otherwise two versions would exchange KV."""
    expected = f"{model_name}@{model_version}"
    if engine.cache_config.namespace != expected:
        raise ConfigError(f"KV offload needs the engine's cache namespace to be {expected!r} "
                          f"(the served name@version), not {engine.cache_config.namespace!r}")


__all__ = ["KVOffload", "check_namespace", "open_kv_offload", "publishing"]
