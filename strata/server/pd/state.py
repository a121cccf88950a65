"""The prefill/decode hand-off parts of one instance (every role has them: a mixed instance can
prefill for another or decode a hand-off; `--role` only tells the gateway what to send where).

    PD
      leases    P: the blocks each answered handle holds (pd/leases.py)
      peers     D: the layouts of the P instances it pulls from (pd/layout.py)
      shm       P: the shared-memory pool a D on this host reads blocks from (pd/shm.py)
      shm_peers D: its mappings of those pools
      staging   D: reused copies of the blocks it read from them
      client    D: HTTP to P (layout, pull, acknowledgement), with the fleet's internal key
      trust     D: which handles it follows (pd/trust.py)
      faults    kill points and damaged blocks for tests (pd/faults.py)
      metrics   strata:pd_* on the server's registry (pd/metrics.py)

`create_app` builds it into `app.state.pd`; its lifespan starts the expiry loop and closes it
(every lease released). The routes are pd/routes.py; the two sides pd/prefill.py and
pd/decode.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Coroutine
from typing import Any

import httpx
from starlette.requests import Request

from strata import tracing
from strata.server.instance import Instance
from strata.server.pd.config import PDConfig
from strata.server.pd.faults import Faults
from strata.server.pd.layout import ModeledLink, PeerLayouts, local_layout
from strata.server.pd.leases import Lease, LeaseTable
from strata.server.pd.metrics import PDMetrics
from strata.server.pd.shm import ShmPeers, ShmPool, Staging
from strata.server.pd.trust import HandleTrust
from strata.tracing.spans import inject_into

log = logging.getLogger("strata.server.pd")


class PD:
    def __init__(self, instance: Instance, config: PDConfig,
                 client: httpx.AsyncClient | None = None) -> None:
        self.instance = instance
        self.config = config
        self.epoch = uuid.uuid4().hex  # this process: handles never outlive it
        self.metrics = PDMetrics(instance.metrics.registry)
        self.faults = Faults(config.faults)
        self.leases = LeaseTable(instance.engine.release_held, lease_s=config.lease_s,
                                 broken_grace_s=config.broken_grace_s,
                                 unpulled_s=config.unpulled_s,
                                 on_release=self._released)
        core = instance.engine.engine
        cache = core.cache_config
        self.executor: object = getattr(core, "executor", None)  # describes its KV layout
        self.layout = local_layout(instance.config.served_model_name,
                                   instance.config.model_version, cache.namespace,
                                   cache.block_size, self.executor)
        # P: blocks by reference for a D on this host (not where the link is modeled)
        self.shm = None if isinstance(self.executor, ModeledLink) else \
            ShmPool.create(config.shm_mb << 20, max_slots=cache.num_blocks)
        if self.shm is not None:
            self.layout["shm"] = self.shm.describe()  # shown, not compared
        self.shm_peers = ShmPeers()  # D: the pools of the P instances on this host
        self.staging = Staging()  # D: reused copies of the blocks read from them
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(
            config.pull_timeout_s, connect=config.connect_timeout_s), event_hooks={
                "request": [inject_into] if tracing.is_on() else []})  # P's spans: D's children
        keys = instance.config.internal_keys
        self.headers = {"authorization": f"Bearer {keys[0]}"} if keys else {}
        registration = instance.registration
        self.trust = HandleTrust(keys, registration.registry if registration else None)
        self.peers = PeerLayouts(self.layout, self.client, self.metrics,
                                 ttl_s=config.peer_ttl_s, timeout_s=config.connect_timeout_s
                                 + 1.0, headers=self.headers)
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self) -> None:
        """The lease expiry loop (also prunes peers and the pools of dead ones), as a task of
        the running loop."""
        self.spawn(self._expire_forever())

    async def _expire_forever(self, interval_s: float = 0.1) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.leases.expire()
                self.peers.prune()
                self.shm_peers.prune()
            except Exception:  # one bad round never stops leases from ending
                log.exception("lease expiry failed")

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` in the background (acknowledgements, the expiry loop); kept referenced
        until done, cancelled at close."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def note_held(self) -> None:
        self.metrics.blocks_held.set(self.leases.num_held_blocks)

    def _released(self, lease: Lease) -> None:
        if self.shm is not None:
            self.shm.release(lease.handle)
        self.metrics.releases.labels(lease.why).inc()
        self.note_held()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.leases.release_all()
        await self.client.aclose()
        if self.shm is not None:
            self.shm.close()
        self.shm_peers.close()


def pd_of(request: Request) -> PD:
    """The hand-off parts of the instance serving `request`."""
    pd: PD = request.app.state.pd
    return pd


__all__ = ["PD", "PDConfig", "pd_of"]
