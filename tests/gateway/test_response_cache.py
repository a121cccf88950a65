"""The gateway's response cache: which requests get a key (and what the key is), what answers are
stored, fresh ids on a hit, and a backend failure (a stopped Redis server) counted, never raised."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer

from strata.errors import ConfigError
from strata.gateway.path.response_cache import ResponseCacheLayer, cache_key, is_deterministic
from strata.state.response_cache import MemoryResponseCache, create_response_cache

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY: dict[str, Any] = {"model": "m", "messages": MESSAGES, "temperature": 0}


def key(body: dict[str, Any], *, path: str = CHAT, model: str = "m",
        version: str = "v1") -> str | None:
    return cache_key(path, body, model=model, version=version)


def answer(*, version: str = "v1", finish_reasons: tuple[str | None, ...] = ("stop",),
           answer_id: str = "chatcmpl-0123") -> bytes:
    choices = [{"index": i, "message": {"role": "assistant", "content": f"answer {i}"},
                "finish_reason": reason} for i, reason in enumerate(finish_reasons)]
    return json.dumps({"id": answer_id, "object": "chat.completion", "created": 1,
                       "model": "m", "choices": choices,
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                       "system_fingerprint": f"strata-0.1.0:m@{version}"}).encode()


def test_the_key_is_the_versioned_sha256_of_the_canonical_request() -> None:
    canonical = ('["/v1/chat/completions",{"messages":[{"content":"hi","role":"user"}],'
                 '"model":"m@v1","temperature":0}]')
    expected = "infer:m:v1:" + hashlib.sha256(canonical.encode()).hexdigest()
    assert key(GREEDY) == expected
    reordered = {"temperature": 0, "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert key(reordered) == expected
    for model in ("m@v1", None):  # the model field is replaced by the resolved name@version
        assert key({**GREEDY, "model": model}) == expected
    assert key({k: v for k, v in GREEDY.items() if k != "model"}) == expected


@pytest.mark.parametrize(("fields", "is_cached"), [
    ({"temperature": 0}, True),
    ({"temperature": 0.0, "n": 3}, True),
    ({"temperature": 0.8, "seed": 7}, True),
    ({"seed": 7, "n": 2}, True),  # choice i is seeded with 7 + i
    ({"seed": 0}, True),
    ({}, False),  # OpenAI's default temperature is 1
    ({"temperature": None}, False),
    ({"temperature": 0.7}, False),
    ({"temperature": 1, "n": 2}, False),
    ({"temperature": 0.7, "seed": None}, False),
    ({"temperature": 0.7, "seed": True}, False),  # a bool is not a seed
    ({"temperature": "0"}, False),  # the instance answers 400; nothing to cache
    ({"temperature": False}, False),
])
def test_only_deterministic_requests_get_a_key(fields: dict[str, Any], is_cached: bool) -> None:
    body = {"messages": MESSAGES, **fields}
    assert is_deterministic(body) is is_cached
    assert (key(body) is not None) is is_cached


def test_streams_sessions_other_paths_and_unknown_versions_bypass_the_cache() -> None:
    assert key({**GREEDY, "stream": True}) is None
    assert key({**GREEDY, "stream": "yes"}) is None
    assert key({**GREEDY, "session_id": "s1"}) is None
    assert key({**GREEDY, "session_id": None}) is None
    assert key(GREEDY, path="/tokenize") is None
    assert key(GREEDY, version="") is None
    assert key(GREEDY, model="") is None
    assert key({**GREEDY, "temperature": 0, "top_p": float("nan")}) is None
    assert key({"prompt": "hi", "temperature": 0}, path="/v1/completions") is not None


def test_fields_that_cannot_change_the_output_do_not_change_the_key() -> None:
    neutral = {"stream": False, "stream_options": {"include_usage": True}, "user": "u-42",
               "priority": 3}
    assert key({**GREEDY, **neutral}) == key(GREEDY)


@pytest.mark.parametrize("change", [
    {"messages": [{"role": "user", "content": "hi!"}]},
    {"messages": [{"role": "system", "content": "hi"}]},
    {"max_tokens": 8},
    {"stop": ["\n"]},
    {"seed": 1},
    {"top_p": 0.5},
    {"logprobs": True},
    {"ignore_eos": True},
    {"cache_salt": "tenant-a"},
])
def test_any_output_relevant_field_changes_the_key(change: dict[str, Any]) -> None:
    changed = key({**GREEDY, **change})
    assert changed is not None and changed.startswith("infer:m:v1:")
    assert changed != key(GREEDY)


def test_the_key_differs_by_version_path_and_model() -> None:
    v1, v2 = key(GREEDY), key(GREEDY, version="v2")
    assert v1 is not None and v2 is not None
    assert (v1[:11], v2[:11]) == ("infer:m:v1:", "infer:m:v2:")
    assert v1[11:] != v2[11:]  # the version is hashed as well as prefixed
    assert key(GREEDY, model="other") != v1
    assert key(GREEDY, path="/v1/completions") != v1


def test_a_hit_is_the_stored_answer_with_a_fresh_id_and_created() -> None:
    layer = ResponseCacheLayer(MemoryResponseCache(), ttl_s=60.0, clock=lambda: 5000.7)
    cache_key_v1 = key(GREEDY)
    assert cache_key_v1 is not None

    async def story() -> None:
        assert await layer.lookup(cache_key_v1) is None
        await layer.store(cache_key_v1, 200, answer())
        first, second = await layer.lookup(cache_key_v1), await layer.lookup(cache_key_v1)
        assert first is not None and second is not None
        stored, hit, again = json.loads(answer()), json.loads(first), json.loads(second)
        assert hit["id"].startswith("chatcmpl-") and len(hit["id"]) == len("chatcmpl-") + 32
        assert len({stored["id"], hit["id"], again["id"]}) == 3
        assert hit["created"] == 5000
        assert {**hit, "id": stored["id"], "created": 1} == stored
        assert (layer.hits, layer.misses, layer.stores, layer.skipped, layer.errors) == \
            (2, 1, 1, 0, 0)

    asyncio.run(story())


def test_only_finished_200_answers_of_the_keys_version_are_stored() -> None:
    cache = MemoryResponseCache(max_entry_bytes=2000)
    layer = ResponseCacheLayer(cache)
    k = key(GREEDY, version="v2")
    assert k is not None
    refused = [
        (500, answer(version="v2")),
        (429, answer(version="v2")),
        (200, answer(version="v2", finish_reasons=("stop", None))),  # one choice cut short
        (200, answer(version="v2", finish_reasons=("abort",))),
        (200, answer(version="v2", finish_reasons=("error",))),
        (200, answer(version="v2", finish_reasons=())),
        (200, answer(version="v1")),  # computed by v1: never served for v2
        (200, b'{"error": "not an answer"}'),
        (200, b"data: {} not json"),
        (200, answer(version="v2", finish_reasons=("stop",) * 40)),  # over max_entry_bytes
    ]

    async def story() -> None:
        for status_code, body in refused:
            await layer.store(k, status_code, body)
            assert await cache.get(k) is None, (status_code, body[:80])
        await layer.store(k, 200, answer(version="v2", finish_reasons=("stop", "length")))
        assert await cache.get(k) == answer(version="v2", finish_reasons=("stop", "length"))

    asyncio.run(story())
    assert (layer.stores, layer.skipped, layer.errors, cache.num_too_large) == (1, 10, 0, 1)


def test_a_stopped_redis_is_counted_and_logged_once_never_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    layer = ResponseCacheLayer(create_response_cache(server.url), ttl_s=60.0)
    k = key(GREEDY)
    assert k is not None

    async def story() -> None:
        await layer.store(k, 200, answer())
        assert await layer.lookup(k) is not None
        server.stop()
        assert await layer.lookup(k) is None
        await layer.store(k, 200, answer())
        assert await layer.lookup(k) is None
        assert (layer.hits, layer.misses, layer.stores, layer.errors) == (1, 0, 1, 3)
        server.start()  # same port, empty (no persistence): the layer recovers by itself
        assert await layer.lookup(k) is None
        await layer.store(k, 200, answer())
        assert await layer.lookup(k) is not None
        assert (layer.hits, layer.misses, layer.stores, layer.errors) == (2, 1, 2, 3)
        await layer.close()

    try:
        with caplog.at_level(logging.INFO, logger="strata.gateway.path.response_cache"):
            asyncio.run(story())
    finally:
        server.stop()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert messages[0].startswith("response cache lookup failed, serving uncached: redis "
                                  f"response cache {server.url}")
    assert messages[1] == "response cache answers again"


def test_the_layer_refuses_a_ttl_that_is_not_positive() -> None:
    with pytest.raises(ConfigError, match="ttl_s must be positive, got 0"):
        ResponseCacheLayer(MemoryResponseCache(), ttl_s=0)
