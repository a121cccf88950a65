"""KV offload between live servers sharing one real Redis (sessions and KV blocks).

Instance A answers a session's first turn and publishes its KV; instance B (cold prefix cache)
answers the second turn, fetching the history's KV instead of recomputing it: its tokens equal
those of an instance that recomputes, and usage and /metrics say where the prefix came from.
An instance serving another model version fetches nothing.
"""

from __future__ import annotations

import asyncio
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from live_server import serve_in_thread, wait_until
from redis_server import redis_server, redis_url  # noqa: F401

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel
from strata.server.app import create_app
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
FIRST = ("the weather in the north was cold and wet all week, so the school closed early and "
         "every student stayed home with a book and a cup of tea while the rain fell")


@dataclass
class Instance:
    url: str
    engine: Engine
    stop: Any

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        match = re.search(rf"^strata:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        assert match is not None, f"{name} not in /metrics"
        return float(match.group(1))


def start(model: LoadedModel, version: str, **options: Any) -> Instance:
    executor = TorchExecutor(model.config, model.weights, dtype="float32", model_name=MODEL,
                             model_version=version)
    engine = Engine(executor,
                    CacheConfig(block_size=8, num_blocks=128, namespace=f"{MODEL}@{version}"),
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                    max_model_len=MAX_MODEL_LEN),
                    model.tokenizer, vocab_size=model.config.vocab_size)
    config = ServerConfig(served_model_name=MODEL, model_version=version, **options)
    app = create_app(AsyncEngine(engine, max_model_len=MAX_MODEL_LEN), model.tokenizer, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, thread = serve_in_thread(app, sock)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return Instance(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, stop)


@pytest.fixture(scope="module")
def fleet(tiny_model: LoadedModel, redis_url: str) -> Iterator[dict[str, Instance]]:  # noqa: F811
    offload = {"kv_offload": True, "kv_store_url": redis_url, "kv_min_fetch_tokens": 0,
               "session_store_url": redis_url}
    instances = {"a": start(tiny_model, "v1", **offload), "b": start(tiny_model, "v1", **offload),
                 "v2": start(tiny_model, "v2", **offload), "recompute": start(tiny_model, "v1")}
    yield instances
    for instance in instances.values():
        instance.stop()


def chat(instance: Instance, messages: list[dict[str, str]], **headers: str) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": True}
    response = httpx.post(f"{instance.url}/v1/chat/completions", json=body, headers=headers,
                          timeout=60)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def tokens_of(answer: dict[str, Any]) -> list[str]:
    return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]


def test_the_next_turn_on_another_instance_fetches_the_history_kv(
        fleet: dict[str, Instance]) -> None:
    a, b, recompute = fleet["a"], fleet["b"], fleet["recompute"]
    session = {"X-Session-Id": f"kv-{uuid.uuid4().hex[:8]}"}
    first = chat(a, [{"role": "user", "content": FIRST}], **session)
    assert wait_until(lambda: a.metric("kv_published_blocks_total") > 0)
    num_published = a.metric("kv_published_blocks_total")
    prompt_1 = first["usage"]["prompt_tokens"]
    assert num_published == (prompt_1 + 8 - 1) // 8  # every computed full block

    second_msg = {"role": "user", "content": "and what about the south?"}
    second = chat(b, [second_msg], **session)
    history = [{"role": "user", "content": FIRST},
               {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
               second_msg]
    reference = chat(recompute, history)
    assert second["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert tokens_of(second) == tokens_of(reference)
    assert second["choices"][0]["message"] == reference["choices"][0]["message"]
    assert reference["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    num_cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert num_cached >= prompt_1 - 8  # at least the first turn's prompt, whole blocks
    assert b.metric("kv_fetched_blocks_total") == num_cached // 8
    assert b.metric("kv_external_hit_tokens_total") == num_cached
    assert b.metric("kv_fetched_bytes_total") > 0
    assert b.metric("kv_decode_failures_total") == 0
    # B publishes only the blocks after those it fetched
    assert wait_until(lambda: b.metric("kv_published_blocks_total") > 0)
    num_total = (second["usage"]["prompt_tokens"] + 8 - 1) // 8
    assert b.metric("kv_published_blocks_total") == num_total - num_cached // 8


def test_another_model_version_fetches_nothing(fleet: dict[str, Instance]) -> None:
    a, v2 = fleet["a"], fleet["v2"]
    messages = [{"role": "user", "content": FIRST + " (v2)"}]
    before = a.metric("kv_published_blocks_total")
    chat(a, messages)
    assert wait_until(lambda: a.metric("kv_published_blocks_total") > before)
    answer = chat(v2, messages)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert v2.metric("kv_fetched_blocks_total") == 0
    assert v2.metric("kv_external_hit_tokens_total") == 0


def test_a_store_that_is_down_costs_a_counted_miss_not_the_request(
        tiny_model: LoadedModel) -> None:
    from redis_server import free_port

    down = start(tiny_model, "v1", kv_offload=True, kv_min_fetch_tokens=0,
                 kv_store_url=f"redis://127.0.0.1:{free_port()}/0")
    try:
        answer = chat(down, [{"role": "user", "content": FIRST}])
        assert answer["choices"][0]["finish_reason"] == "length"
        assert down.metric("kv_fetch_errors_total") == 1
        assert wait_until(lambda: down.metric("kv_publish_errors_total") == 1)
    finally:
        down.stop()


def test_offload_settings_say_what_to_change(tiny_model: LoadedModel) -> None:
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="pass --kv-store URL"):
        ServerConfig(served_model_name=MODEL, kv_offload=True)
    with pytest.raises(ConfigError, match="kv ttl_s must be positive"):
        ServerConfig(served_model_name=MODEL, kv_ttl_s=0)
    executor = TorchExecutor(tiny_model.config, tiny_model.weights, dtype="float32")
    engine = Engine(executor, CacheConfig(block_size=8, num_blocks=16, namespace="other@v9"),
                    SchedulerConfig(max_model_len=64), tiny_model.tokenizer)
    config = ServerConfig(served_model_name=MODEL, kv_offload=True, kv_store_url="memory://")
    async_engine = AsyncEngine(engine, max_model_len=64)
    app = create_app(async_engine, tiny_model.tokenizer, config)
    with pytest.raises(ConfigError, match="namespace to be 'tiny-llama@default'"):
        with TestClient(app):
            pass
    asyncio.run(async_engine.shutdown(0))
