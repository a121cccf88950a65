"""The I/O side of `--policy cache_aware`: feeds the prefix index and keys each request.

    PrefixRouting
      index        the policy's PrefixIndex (prefix_index.py): pure, clock-driven
      run()        background: one long-poll loop per ready instance on
                   GET {url}/v1/strata/kv-events (strata/protocol/kv_events.py), started and
                   stopped as instances come and go; expires silent instances
      identities   instance id -> block size, namespace, tokenizer fingerprint (from its answers)
      hashers      fingerprint -> PromptHasher, fetched once per fingerprint from
                   GET {url}/v1/strata/tokenizer, built off the event loop
      keys()       a request's keys for each candidate (the KeyPrefix step in forward.py)

A poll answers at once when the instance has news and otherwise within `wait_s`, so an answer
at least every `wait_s` is the instance's heartbeat; a failed poll forgets the instance's blocks
at once (it died or restarted) and the next poll asks for a snapshot. An instance that answers
404 publishes nothing (not a Strata instance, or no prefix cache): it is asked again every
`retry_unsupported_s`, and meanwhile routed by text keys and routing history.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from strata.errors import StrataError
from strata.gateway.path.requests import DEFAULT_MAX_TOKENS
from strata.gateway.routing.instances import READY, InstanceSet, InstanceView
from strata.gateway.routing.prefix.index import BlockBatch, PrefixIndex
from strata.gateway.routing.prefix.prompt import (
    KeySet,
    PrefixKeys,
    Prompt,
    PromptHasher,
    id_keys,
    prompt_of,
    text_keys,
)
from strata.protocol.kv_events import EVENTS_PATH, TOKENIZER_PATH, CacheIdentity, EventsAnswer

logger = logging.getLogger("strata.gateway.prefix")


@dataclass(frozen=True, slots=True)
class FeedConfig:
    wait_s: float = 0.5  # an idle instance answers this often (the heartbeat)
    min_poll_interval_s: float = 0.1  # under load, batches arrive at most this often
    sync_interval_s: float = 0.25
    retry_s: float = 0.5
    retry_unsupported_s: float = 30.0


class PrefixRouting:
    """Keeps the index fed and keys requests (see the module docstring)."""

    def __init__(self, index: PrefixIndex, instances: InstanceSet, client: httpx.AsyncClient, *,
                 api_key: str | None = None, config: FeedConfig | None = None,
                 is_per_tenant: bool = False,
                 is_needed: Callable[[InstanceSet], bool] | None = None) -> None:
        self.index = index
        # None: always followed; else only while it holds (the P/D decider's index needs no
        # feed while the fleet has no prefill instance: no request is handed off)
        self.is_needed = is_needed
        # the instances put the caller's tenant in the cache salt (client keys on): so do keys
        self.is_per_tenant = is_per_tenant
        self.instances = instances
        self.client = client
        self.config = config or FeedConfig()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.identities: dict[str, CacheIdentity] = {}
        self.hashers: dict[str, PromptHasher] = {}
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._followers: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self.num_polls = 0
        self.num_poll_failures = 0

    # --- keys ---------------------------------------------------------------------------------

    def is_keying(self) -> bool:
        """Whether requests need keys now: not while the feed is not needed (the P/D
        decision's index, with no prefill instance: nothing reads them)."""
        return self.is_needed is None or self.is_needed(self.instances)

    def keys(self, body: dict[str, Any] | None, session_id: str | None,
             candidates: Sequence[InstanceView], tenant: str = "") -> PrefixKeys | None:
        """The request's keys per candidate; None without a prompt to key (or for a session
        turn, whose history the instance prepends). `tenant` ("": none) salts them as the
        instance salts the caller's blocks (strata/server/translate.py `tenant_scoped`). `body`
        is the request's parsed body (None: not a JSON object)."""
        if session_id is not None or not candidates or body is None:
            return None
        prompt = prompt_of(body)
        if prompt is None:
            return None
        if tenant:
            prompt = dataclasses.replace(prompt, cache_salt=f"{tenant}:{prompt.cache_salt}")
        sets: dict[CacheIdentity | None, KeySet] = {}
        by_instance = {}
        for view in candidates:
            identity = self._exact_identity(view.instance_id, prompt)
            keyset = sets.get(identity)
            if keyset is None:
                keyset = sets[identity] = self._keyset(prompt, identity)
            by_instance[view.instance_id] = keyset
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        return PrefixKeys(by_instance, max_tokens if isinstance(max_tokens, int)
                          else DEFAULT_MAX_TOKENS)

    def _exact_identity(self, instance_id: str, prompt: Prompt) -> CacheIdentity | None:
        """The instance's identity when its block hashes can be computed, else None."""
        identity = self.identities.get(instance_id)
        if identity is None:
            return None
        if prompt.token_ids is not None or identity.tokenizer in self.hashers:
            return identity
        return None

    def _keyset(self, prompt: Prompt, identity: CacheIdentity | None) -> KeySet:
        if identity is None:
            return text_keys(prompt)
        if prompt.token_ids is not None:
            return id_keys(prompt, identity.block_size, identity.namespace)
        hasher = self.hashers[str(identity.tokenizer)]
        try:
            return hasher.keys(prompt, identity.block_size, identity.namespace)
        except (StrataError, ValueError, TypeError):  # the instance will answer 400
            return text_keys(prompt)

    # --- the feed -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Follows the ready instances until cancelled."""
        try:
            while True:
                self.sync()
                for instance_id in self.index.expire():
                    self.identities.pop(instance_id, None)
                await asyncio.sleep(self.config.sync_interval_s)
        finally:
            await self.close()

    def sync(self) -> None:
        """One poll loop per ready instance; instances gone or not ready are forgotten (all
        of them while the index is not needed)."""
        is_needed = self.is_needed is None or self.is_needed(self.instances)
        wanted = {v.instance_id: v.url for v in self.instances.snapshot()
                  if v.state == READY and is_needed}
        for instance_id, (url, task) in list(self._followers.items()):
            if wanted.get(instance_id) != url:
                task.cancel()
                del self._followers[instance_id]
                self._forget(instance_id)
        for instance_id, url in wanted.items():
            if instance_id not in self._followers:
                task = asyncio.create_task(self._follow(instance_id, url),
                                           name=f"prefix-feed-{instance_id}")
                self._followers[instance_id] = (url, task)

    @property
    def followed(self) -> list[str]:
        """The instances whose feeds are followed now."""
        return sorted(self._followers)

    async def close(self) -> None:
        tasks = [task for _, task in self._followers.values()] + list(self._loading.values())
        self._followers.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, instance_id: str) -> None:
        self.index.forget(instance_id)
        self.identities.pop(instance_id, None)

    async def _follow(self, instance_id: str, url: str) -> None:
        cursor: tuple[float, int] | None = None
        while True:
            try:
                answer = await self._poll(url, cursor)
            except Exception as exc:  # any failure: what we knew of it may be wrong now
                self.num_poll_failures += 1
                self._forget(instance_id)
                cursor = None
                unsupported = isinstance(exc, httpx.HTTPStatusError) and \
                    exc.response.status_code == 404
                await asyncio.sleep(self.config.retry_unsupported_s if unsupported
                                    else self.config.retry_s)
                continue
            cursor, has_news = self._apply(instance_id, url, answer)
            if has_news:
                await asyncio.sleep(self.config.min_poll_interval_s)

    async def _poll(self, url: str, cursor: tuple[float, int] | None) -> EventsAnswer:
        self.num_polls += 1
        params: dict[str, str] = {"wait_s": str(self.config.wait_s)}
        if cursor is not None:
            params["epoch"], params["after"] = repr(cursor[0]), str(cursor[1])
        response = await self.client.get(f"{url}{EVENTS_PATH}", params=params,
                                         headers=self.headers,
                                         timeout=self.config.wait_s + 1.0)
        response.raise_for_status()
        return EventsAnswer.from_json(response.json())

    def _apply(self, instance_id: str, url: str,
               answer: EventsAnswer) -> tuple[tuple[float, int], bool]:
        epoch, tokenizer = answer.epoch, answer.identity.tokenizer
        self.identities[instance_id] = answer.identity
        if tokenizer and tokenizer not in self.hashers and tokenizer not in self._loading:
            self._loading[tokenizer] = asyncio.create_task(self._load_tokenizer(url, tokenizer))
        if answer.snapshot is not None:
            self.index.apply(instance_id, BlockBatch(epoch, answer.snapshot.seq,
                                                     answer.snapshot.stored, is_snapshot=True))
        for batch in answer.batches:
            self.index.apply(instance_id, BlockBatch(epoch, batch.seq, batch.stored,
                                                     batch.removed))
        if not answer.has_news:
            self.index.heard(instance_id, epoch)
        return (epoch, answer.seq), answer.has_news

    async def _load_tokenizer(self, url: str, fingerprint: str) -> None:
        try:
            response = await self.client.get(f"{url}{TOKENIZER_PATH}", headers=self.headers,
                                             timeout=30.0)
            response.raise_for_status()
            spec = response.json()
            if spec.get("fingerprint") != fingerprint:
                raise ValueError("the tokenizer changed while it was fetched")
            self.hashers[fingerprint] = await asyncio.to_thread(PromptHasher, spec)
        except Exception as exc:
            logger.warning("cannot load the tokenizer of %s: %r; routing by text until then",
                           url, exc)
            await asyncio.sleep(self.config.retry_unsupported_s)
        finally:
            self._loading.pop(fingerprint, None)


__all__ = ["FeedConfig", "PrefixRouting"]
