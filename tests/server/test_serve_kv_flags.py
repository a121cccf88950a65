"""Each `--kv-*` flag of `strata serve`, through the CLI as a user runs it: real `strata serve`
processes on a tiny model, real Redis servers, and what each flag changes, seen from outside
(usage, /metrics, the keys and settings in Redis).

    publisher   --kv-offload --kv-store R1/1 --kv-ttl-s 120 --kv-min-fetch-tokens 0
    fetcher     --kv-offload --kv-store R1/1 --kv-min-fetch-tokens 0
    no_fetch    --kv-offload --kv-store R1/1 --kv-min-fetch-tokens 100000
    off         --kv-store R1/3 (no --kv-offload)
    capped      --kv-offload --kv-store R2/0 --kv-max-put-mb 0.01 --kv-redis-maxmemory-mb 64
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from harness.procs import Proc, spawn, wait_until
from redis_server import RedisServer
from tiny_models import make_tiny_model_dir

MODEL = "tiny"
BLOCK_SIZE = 8
MAX_TOKENS = 4
PROMPT = ("the weather in the north was cold and wet all week, so the school closed early and "
          "every student stayed home")
READY = r"Strata serving \S+ on (http://127\.0\.0\.1:\d+) \(ready in"
KEY_PREFIX = "strata:kv:"
MAX_PUT_MB = 0.01

pytestmark = pytest.mark.timeout(300)


@dataclass
class Fleet:
    redis_1: RedisServer  # the shared KV store
    redis_2: RedisServer  # the capped instance's own
    instances: dict[str, Proc]

    def url(self, name: str) -> str:
        return self.instances[name].url

    def db(self, server: RedisServer, number: int) -> redis.Redis:
        return redis.Redis(port=server.port, db=number)


def serve_argv(model_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "strata.cli", "serve", str(model_dir), "--served-model-name",
            MODEL, "--dtype", "float32", "--device", "cpu", "--threads", "1", "--kv-cache-gb",
            "0.01", "--block-size", str(BLOCK_SIZE), "--port", "0", "--log-level", "warning",
            *flags]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("kv-flags")
    model_dir = make_tiny_model_dir(root / "tiny", torch_dtype="float32")
    r1, r2 = RedisServer(root / "redis-1"), RedisServer(root / "redis-2")
    r1.start()
    r2.start()
    shared = f"redis://127.0.0.1:{r1.port}/1"
    flags = {
        "publisher": ("--kv-offload", "--kv-store", shared, "--kv-ttl-s", "120",
                      "--kv-min-fetch-tokens", "0"),
        "fetcher": ("--kv-offload", "--kv-store", shared, "--kv-min-fetch-tokens", "0"),
        "no_fetch": ("--kv-offload", "--kv-store", shared, "--kv-min-fetch-tokens", "100000"),
        "off": ("--kv-store", f"redis://127.0.0.1:{r1.port}/3"),
        "capped": ("--kv-offload", "--kv-store", r2.url, "--kv-min-fetch-tokens", "0",
                   "--kv-max-put-mb", str(MAX_PUT_MB), "--kv-redis-maxmemory-mb", "64"),
    }
    env = {**os.environ, "STRATA_CACHE_DIR": str(root / "cache")}
    procs = {name: spawn(name, serve_argv(model_dir, *f), root, env=env)
             for name, f in flags.items()}  # all at once: the starts overlap
    try:
        for proc in procs.values():
            proc.url = proc.wait_for_output(READY, 120).group(1)
        yield Fleet(r1, r2, procs)
    finally:
        for proc in procs.values():
            proc.kill()
        r1.stop()
        r2.stop()


def complete(url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def metric(url: str, name: str) -> float:
    """A counter of the instance's /metrics (summed over labels; 0 if absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"strata:{name}"))


def cached_tokens(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def num_blocks(answer: dict[str, Any]) -> int:
    """The full blocks a finished request computed (its last token's KV is never computed)."""
    return (answer["usage"]["prompt_tokens"] + MAX_TOKENS - 1) // BLOCK_SIZE


@pytest.fixture(scope="module")
def published(fleet: Fleet) -> dict[str, Any]:
    """The publisher's answer, once its blocks are in the store."""
    answer = complete(fleet.url("publisher"))
    wait_until(lambda: metric(fleet.url("publisher"), "kv_published_blocks_total")
               == num_blocks(answer), 30, "the publisher's blocks")
    return answer


def test_kv_offload_publishes_and_fetches_and_without_it_nothing_moves(
        fleet: Fleet, published: dict[str, Any]) -> None:
    fetched = complete(fleet.url("fetcher"))
    assert cached_tokens(fetched) == published["usage"]["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert metric(fleet.url("fetcher"), "kv_fetched_blocks_total") == cached_tokens(fetched) \
        // BLOCK_SIZE
    assert fetched["choices"][0]["text"] == published["choices"][0]["text"]
    off = complete(fleet.url("off"))
    assert cached_tokens(off) == 0 and off["choices"][0]["text"] == fetched["choices"][0]["text"]
    assert metric(fleet.url("off"), "kv_fetched_blocks_total") == 0
    assert metric(fleet.url("off"), "kv_published_blocks_total") == 0
    assert fleet.db(fleet.redis_1, 3).dbsize() == 0  # its --kv-store was never written


def test_kv_store_puts_the_blocks_in_that_redis_database(
        fleet: Fleet, published: dict[str, Any]) -> None:
    keys = fleet.db(fleet.redis_1, 1).keys("*")
    assert len(keys) == num_blocks(published)
    assert all(key.startswith(KEY_PREFIX.encode()) for key in keys)
    assert fleet.db(fleet.redis_1, 0).dbsize() == 0


def test_kv_ttl_s_sets_the_expiry_of_each_block(fleet: Fleet, published: dict[str, Any]) -> None:
    shared = fleet.db(fleet.redis_1, 1)
    ttls_ms = [shared.pttl(key) for key in shared.keys("*")]
    assert ttls_ms and all(0 < ttl <= 120_000 for ttl in ttls_ms)  # the default is 3,600,000


def test_kv_min_fetch_tokens_keeps_shorter_prompts_from_fetching(
        fleet: Fleet, published: dict[str, Any]) -> None:
    answer = complete(fleet.url("no_fetch"))
    assert answer["usage"]["prompt_tokens"] < 100_000
    assert cached_tokens(answer) == 0
    assert metric(fleet.url("no_fetch"), "kv_fetched_blocks_total") == 0


def test_kv_max_put_mb_publishes_only_the_leading_blocks_that_fit(fleet: Fleet) -> None:
    answer = complete(fleet.url("capped"))
    store = fleet.db(fleet.redis_2, 0)
    wait_until(lambda: metric(fleet.url("capped"), "kv_published_blocks_total") > 0, 30,
               "the capped instance's blocks")
    keys = store.keys("*")
    block_bytes = max(store.strlen(key) for key in keys)
    fit = int(MAX_PUT_MB * (1 << 20)) // block_bytes
    assert 0 < fit < num_blocks(answer)
    assert metric(fleet.url("capped"), "kv_published_blocks_total") == len(keys) == fit


def test_kv_redis_maxmemory_mb_configures_the_kv_redis(fleet: Fleet) -> None:
    complete(fleet.url("capped"))  # the store configures Redis before its first command
    wait_until(lambda: metric(fleet.url("capped"), "kv_published_blocks_total") > 0, 30,
               "the capped instance's blocks")
    config = fleet.db(fleet.redis_2, 0).config_get("maxmemory*")
    assert config["maxmemory"] == str(64 << 20)
    assert config["maxmemory-policy"] == "allkeys-lru"
    assert fleet.db(fleet.redis_1, 0).config_get("maxmemory")["maxmemory"] == "0"  # untouched
