"""The hand-off handshake: what a block's bytes mean here, compared with a peer's before the
first pull from it.

An instance describes its KV as `local_layout`: the served model and version, the hash namespace,
the block size, and what the executor says its payloads depend on (dtype, layers, KV heads, head
dim, payload format). D fetches P's (`GET {P}/internal/kv/layout`) and refuses a peer whose
layout differs in any compared field (`FIELDS`), by name; a refused P's blocks and first token
are never used (D prefills locally). Answers are cached per peer URL and process epoch (a
restarted P is asked again), dropped on the first error talking to that peer, and forgotten
`ttl_s` after they were fetched, so nothing of a dead peer outlives it by more than that.

A P with a shared-memory pool (pd/shm.py) names it in `shm` (path and token), shown and not
compared: D reads blocks from it when it can open it, and pulls the stream otherwise.

How the instance splits its KV over tensor- and pipeline-parallel ranks (`parallel`: T, P, the KV
heads of each tp rank, the layers of each stage) travels too, and is not compared: a block leaves
and enters in the whole model's layout (`num_layers` and `num_kv_heads` are the model's; the
payload's header says the same), assembled from every rank on export and sliced to each rank's
heads and layers on import, so a T=2 prefill instance feeds a T=1 or a P=2 decode instance:

    P (T=2): rank 0 heads 0-1, rank 1 heads 1-2  -> whole block (3 heads) ->  D (T=1): heads 0-2
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from strata.clock import Clock
from strata.protocol.pd import LAYOUT_PATH
from strata.server.pd.metrics import PDMetrics
from strata.server.pd.wire import FORMAT

log = logging.getLogger("strata.server.pd")

# the fields compared, in the order a refusal names them (`parallel` is shown, not compared)
FIELDS = ("format", "model", "version", "namespace", "dtype", "block_size", "num_layers",
          "num_kv_heads", "head_dim", "codec_format", "kv_bytes_per_token")


@runtime_checkable
class DescribesKV(Protocol):
    """An executor that says what its exported blocks depend on (TorchExecutor,
    ParallelExecutor, the simulator)."""

    def kv_layout(self) -> dict[str, Any]: ...


@runtime_checkable
class ModeledLink(Protocol):
    """An executor whose exported blocks stand for bytes on a modeled link (the simulator's
    stand-ins): the pull waits the time they take, off the engine thread, and no pool in
    shared memory short-cuts it."""

    def link_s(self, num_blocks: int) -> float: ...


def local_layout(model: str, version: str, namespace: str, block_size: int,
                 executor: object) -> dict[str, Any]:
    described = executor.kv_layout() if isinstance(executor, DescribesKV) else {}
    return {**described, "format": FORMAT, "model": model, "version": version,
            "namespace": namespace, "block_size": block_size}


def differences(local: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    """The compared fields that differ, in `FIELDS` order."""
    return [name for name in FIELDS if local.get(name) != peer.get(name)]


def explain(local: dict[str, Any], peer: dict[str, Any], fields: list[str]) -> str:
    return ", ".join(f"{name}: {local.get(name)!r} here, {peer.get(name)!r} at the peer"
                     for name in fields)


@dataclass(slots=True)
class _Peer:
    epoch: str
    refusal: str | None  # None: compatible
    fetched_at: float
    shm: object = None  # its shared-memory pool, as it described it (pd/shm.py)


class PeerLayouts:
    """D's view of the P instances it pulled from (see the module docstring)."""

    def __init__(self, local: dict[str, Any], client: httpx.AsyncClient, metrics: PDMetrics,
                 *, ttl_s: float = 2.0, timeout_s: float = 2.0,
                 headers: dict[str, str] | None = None,
                 clock: Clock = time.monotonic) -> None:
        self.local = local
        self.client = client
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.headers = headers or {}
        self.clock = clock
        self._peers: dict[str, _Peer] = {}

    def __contains__(self, url: str) -> bool:
        return url in self._peers

    async def check(self, url: str, epoch: str) -> str | None:
        """None when P at `url` (process `epoch`) is compatible, else why not."""
        self.prune()
        peer = self._peers.get(url)
        if peer is not None and peer.epoch == epoch:
            return peer.refusal
        try:
            response = await self.client.get(url + LAYOUT_PATH, headers=self.headers,
                                              timeout=self.timeout_s)
            response.raise_for_status()
            remote: dict[str, Any] = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.forget(url)
            return f"the prefill instance at {url} did not answer its layout: {exc}"
        if remote.get("epoch") != epoch:
            return f"the prefill instance at {url} restarted since it answered the handle"
        refusal = self._refusal(url, remote)
        self._peers[url] = _Peer(epoch, refusal, self.clock(), remote.get("shm"))
        return refusal

    def shm_of(self, url: str) -> object:
        """The shared-memory pool the compatible peer at `url` described, if any."""
        peer = self._peers.get(url)
        return peer.shm if peer is not None and peer.refusal is None else None

    def _refusal(self, url: str, remote: dict[str, Any]) -> str | None:
        fields = differences(self.local, remote)
        if not fields:
            return None
        self.metrics.refusals.labels(fields[0]).inc()
        refusal = f"layout mismatch with {url}: {explain(self.local, remote, fields)}"
        log.warning("hand-off refused: %s", refusal)
        return refusal

    def forget(self, url: str) -> None:
        self._peers.pop(url, None)

    def prune(self) -> None:
        """Drop answers older than `ttl_s`."""
        horizon = self.clock() - self.ttl_s
        for url in [u for u, p in self._peers.items() if p.fetched_at <= horizon]:
            del self._peers[url]


__all__ = ["FIELDS", "DescribesKV", "ModeledLink", "PeerLayouts", "differences", "explain",
           "local_layout"]
