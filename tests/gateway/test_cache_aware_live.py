"""Cache-aware routing over real sockets and processes.

1. A real simulated instance (uvicorn) and the gateway's feed (PrefixRouting, real httpx): the
   gateway keys a chat prompt with the tokenizer it fetched, and its index, fed by the instance's
   events, holds every full block of it; the instance killed, its entries are gone within 1 s;
   restarted on the same port (a new epoch), the index holds the new process's blocks only.
2. `strata up --simulate` with 4 instances, the same shared-prefix workload through the gateway
   with --policy cache_aware and with round_robin: cache_aware's prefix-cache hit rate (from the
   instances' own usage counts) is higher.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from cluster_process import start_cluster
from live_fleet import free_socket
from live_server import serve_in_thread

from strata.gateway.routing.instances import InstanceSet, InstanceView
from strata.gateway.routing.prefix.feed import FeedConfig, PrefixRouting
from strata.gateway.routing.prefix.index import PrefixIndex
from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine
from strata.sim.tokenizer import WORDS

MODEL = "sim-model"
FAST = LatencyProfile(model=MODEL, source="synthetic", prefill_ms_base=0.1,
                      prefill_ms_per_token=0.001, decode_ms_base=0.2, decode_ms_per_seq=0.01)


def start_instance(sock: socket.socket) -> Callable[[], None]:
    async_engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        FAST, kv_blocks=256, max_model_len=1024, namespace=f"{MODEL}@v1"))
    app = create_app(async_engine, tokenizer, ServerConfig(served_model_name=MODEL))
    server, thread = serve_in_thread(app, sock)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return stop


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def chat_body(system: str, user: str) -> bytes:
    return httpx.Request("POST", "http://x", json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }).content


def test_the_feed_mirrors_the_instance_and_forgets_it_when_its_poll_fails() -> None:
    sock = free_socket()
    port = sock.getsockname()[1]
    stop = start_instance(sock)
    url = f"http://127.0.0.1:{port}"
    view = InstanceView("i1", url, MODEL)
    index = PrefixIndex()
    system = " ".join(random.Random(1).choice(WORDS) for _ in range(200))

    async def story() -> None:
        nonlocal stop
        async with httpx.AsyncClient() as client:
            routing = PrefixRouting(index, InstanceSet([view]), client,
                                    config=FeedConfig(wait_s=0.2, retry_s=0.1))
            feed = asyncio.create_task(routing.run())
            await until(lambda: "i1" in routing.identities and routing.hashers, 30,
                        "the identity and the tokenizer")
            body = chat_body(system, "hello there")
            keys = routing.keys(json.loads(body), None, [view])
            assert keys is not None
            keyset = keys.for_instance("i1")
            assert keyset is not None and keyset.tokens_per_key == 16
            assert len(keyset.keys) == keyset.num_prompt_tokens // 16 > 10
            assert index.match("i1", keyset.keys) == 0
            answer = await client.post(f"{url}/v1/chat/completions", content=body,
                                       headers={"content-type": "application/json"})
            assert answer.json()["usage"]["prompt_tokens"] == keyset.num_prompt_tokens
            await until(lambda: index.match("i1", keyset.keys) == len(keyset.keys), 5,
                        "the instance's events")
            old_epoch = index._reported["i1"].epoch

            failures = routing.num_poll_failures
            await asyncio.to_thread(stop)  # the instance goes away
            # its entries go because the feed's poll failed (the instance is gone), not because
            # they aged out; bench/fault_detection.py measures how soon, and the wait here
            # keeps far more than 5x headroom over that
            await until(lambda: index.match("i1", keyset.keys) == 0, 10, "the entries to go")
            assert routing.num_poll_failures > failures
            assert not index.is_reporting("i1") and index.num_blocks("i1") == 0

            stop = start_instance(free_socket(port))  # back on the same port: a new process
            await until(lambda: index.is_reporting("i1"), 10, "the restarted instance")
            assert index._reported["i1"].epoch > old_epoch
            assert index.match("i1", keyset.keys) == 0  # the new process caches nothing yet
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)

    try:
        asyncio.run(story())
    finally:
        stop()


def hit_rate(url: str, tenants: list[str], num_requests: int, seed: int) -> float:
    """Prompt tokens served from the prefix cache / prompt tokens, over a Zipf-ish workload."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(len(tenants))]
    prompt = cached = 0

    async def one(client: httpx.AsyncClient, system: str, user: str) -> tuple[int, int]:
        answer = await client.post("/v1/chat/completions", content=chat_body(system, user),
                                   headers={"content-type": "application/json"})
        usage = answer.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            results = []
            for start in range(0, num_requests, 4):  # 4 at a time
                batch = [one(client, rng.choices(tenants, weights)[0], f"q{start + k} "
                             + " ".join(rng.choice(WORDS) for _ in range(8)))
                         for k in range(4)]
                results += await asyncio.gather(*batch)
            return results

    for p, c in asyncio.run(run()):
        prompt, cached = prompt + p, cached + c
    return cached / prompt


@pytest.mark.timeout(300)
def test_cache_aware_beats_round_robin_on_hit_rate(tmp_path: Path) -> None:
    FAST.save(tmp_path / "profile.json")
    rng = random.Random(7)
    tenants = [" ".join(rng.choice(WORDS) for _ in range(400)) for _ in range(12)]
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        # a tenant's prompt fills about 26 blocks: 160 per instance hold 6 of the 12, so round
        # robin, which makes every instance cache every tenant, evicts; cache_aware keeps about
        # 3 tenants per instance
        cluster = start_cluster(["--simulate", str(tmp_path / "profile.json"),
                                 "--served-model-name", MODEL, "--policy", policy,
                                 "--kv-cache-gb", str(160 * 16 * 23040 / (1 << 30))],
                                tmp_path / policy, replicas=4)
        try:
            rates[policy] = hit_rate(cluster.url, tenants, 96, seed=11)
        finally:
            assert cluster.stop() == 0
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates
