"""Every error a client can cause, over real sockets: status, OpenAI body, headers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from live_server import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    GatedExecutor,
    LiveServer,
    start_server,
    wait_until,
)

from strata.model.loader import LoadedModel


def post(live: LiveServer, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.post(f"{live.base_url}{path}", json=body, timeout=30, **kw)


def assert_error(r: httpx.Response, status: int, *, param: str | None = None,
                 contains: tuple[str, ...] = ()) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    for text in contains:
        assert text in error["message"]
    return error


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(("change", "param"), [
    ({"temperature": 5}, "temperature"),
    ({"n": 9}, "n"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"n": "2"}, "n"),
    ({"max_tokens": "lots"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}, None),
])
def test_invalid_parameters_are_400(live: LiveServer, change: dict[str, Any],
                                    param: str | None) -> None:
    error = assert_error(post(live, "/v1/chat/completions", CHAT | change), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("change", [
    {"functions": [{"name": "f", "parameters": {}}]},
    {"best_of": 3},
    {"suffix": "x"},
    {"min_p": 0.1},
    {"prediction": {"type": "content", "content": "x"}},
    {"modalities": ["text", "audio"]},
    {"use_beam_search": True},
    {"prompt_logprobs": 2},
])
def test_unsupported_openai_features_are_refused_not_ignored(live: LiveServer,
                                                             change: dict[str, Any]) -> None:
    name = next(iter(change))
    assert_error(post(live, "/v1/chat/completions", CHAT | change), 400,
                 contains=(f"{name} is not supported",))
    ok = post(live, "/v1/chat/completions", CHAT | {"response_format": {"type": "text"}})
    assert ok.status_code == 200


def test_openai_client_sees_bad_request(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=5)
    assert info.value.status_code == 400


def test_malformed_json_is_400(live: LiveServer) -> None:
    r = httpx.post(f"{live.base_url}/v1/completions", content=b'{"prompt": "x",',
                   headers={"content-type": "application/json"})
    assert_error(r, 400, contains=("not valid JSON",))
    assert_error(post(live, "/v1/completions", [1, 2]), 400, contains=("JSON object",))


def test_prompt_longer_than_the_context_names_both_numbers(live: LiveServer) -> None:
    r = post(live, "/v1/completions", {"model": MODEL_NAME, "prompt": list(range(200))})
    assert_error(r, 400, contains=(str(MAX_MODEL_LEN), "200"))
    r = post(live, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN})
    assert_error(r, 400, contains=(str(MAX_MODEL_LEN), str(MAX_MODEL_LEN + 3)))


def test_unknown_model_is_404(live: LiveServer) -> None:
    error = assert_error(post(live, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404,
                         param="model", contains=("gpt-9",))
    assert error["type"] == "not_found_error"


def test_model_version_is_checked_never_silently_another(live: LiveServer) -> None:
    """`name@version` names the version; another version of the model is a 404, and every
    answer says which version computed it."""
    body = {"model": f"{MODEL_NAME}@v9", "prompt": "x", "max_tokens": 1}
    error = assert_error(post(live, "/v1/completions", body), 404, param="model",
                         contains=("v9", f"{MODEL_NAME}@default"))
    assert error["type"] == "not_found_error"
    r = post(live, "/v1/completions", body | {"model": f"{MODEL_NAME}@default"})
    assert r.status_code == 200, r.text
    assert r.headers["x-model-version"] == f"{MODEL_NAME}@default"
    assert r.json()["system_fingerprint"].endswith(f":{MODEL_NAME}@default")
    assert post(live, "/v1/completions", {"prompt": "x", "max_tokens": 1}
                ).headers["x-model-version"] == f"{MODEL_NAME}@default"


def test_oversized_body_is_413(live: LiveServer) -> None:
    huge = {"model": MODEL_NAME, "prompt": "x" * (live.config.max_body_bytes + 1)}
    assert_error(post(live, "/v1/completions", huge), 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it streams
        yield b'{"prompt": "'
        for _ in range(live.config.max_body_bytes // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(f"{live.base_url}/v1/completions", content=chunked(),
                   headers={"content-type": "application/json"})
    assert_error(r, 413)


@pytest.fixture(scope="module")
def gated(tiny_model: LoadedModel) -> Iterator[tuple[LiveServer, GatedExecutor]]:
    holder: list[GatedExecutor] = []

    def wrap(inner: object) -> GatedExecutor:
        holder.append(GatedExecutor(inner))
        return holder[0]

    server = start_server(tiny_model, max_waiting=1, max_num_seqs=1, wrap=wrap)
    yield server, holder[0]
    holder[0].open()
    server.stop()


async def _post_async(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(url, json=body)


def test_full_waiting_queue_is_429_with_retry_after(
        gated: tuple[LiveServer, GatedExecutor]) -> None:
    live, gate = gated
    url = f"{live.v1}/completions"
    body = {"prompt": "queue", "max_tokens": 4, "ignore_eos": True}

    async def story() -> list[httpx.Response]:
        gate.hold()
        first = asyncio.create_task(_post_async(url, body))  # runs, stuck in its first step
        await asyncio.to_thread(wait_until, lambda: gate.num_blocked >= 1)
        others = [asyncio.create_task(_post_async(url, body)) for _ in range(2)]
        await asyncio.to_thread(wait_until, lambda: live.async_engine.num_in_flight == 3)
        gate.open()  # one of the two waits (max_waiting=1), the other is refused
        return await asyncio.gather(first, *others)

    responses = asyncio.run(story())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 429]
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "overloaded_error"
    assert wait_until(lambda: live.async_engine.stats().num_running == 0)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(
        gated: tuple[LiveServer, GatedExecutor]) -> None:
    live, gate = gated
    before = live.engine.stats().num_generated_tokens
    gate.hold(allow=2)  # prefill + one decode, then the engine stalls
    body = {"prompt": "leave early", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{live.v1}/completions", json=body, timeout=30) as r:
        # headers come once the first token exists: the stream is under way (its first tokens
        # may all be held back as partial characters, so no data line is awaited)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
    assert wait_until(lambda: live.async_engine.num_in_flight == 0)  # the server saw it go
    gate.open()
    assert wait_until(lambda: live.async_engine.stats().num_running == 0)
    stats = live.async_engine.stats()
    assert stats.num_waiting == 0 and stats.kv_usage == 0.0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_generated_tokens - before <= 3  # aborted long before 100
    live.engine.check_integrity()


def test_draining_refuses_new_requests_with_503(
        gated: tuple[LiveServer, GatedExecutor]) -> None:
    live, _ = gated
    app = live.server.config.app
    app.state.instance.is_draining = True
    try:
        r = post(live, "/v1/completions", {"prompt": "x"})
        assert_error(r, 503)
        assert r.headers["retry-after"] == "1"
        assert httpx.get(f"{live.base_url}/ready").status_code == 503
        assert httpx.get(f"{live.base_url}/health").status_code == 200
    finally:
        app.state.instance.is_draining = False
