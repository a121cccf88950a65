"""The hand-off between live instances of the tiny model (float32), the gateway's two calls
made by the test: what D answers after pulling from P is what one mixed instance answers,
token for token, with the same usage, cached_tokens and logprobs, streamed or not."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_server import wait_until
from pd_fleet import (
    BLOCK,
    FLEET,
    Instance,
    comparable,
    decode,
    mixed,
    prefill,
    start_instance,
    stream_decode,
    stream_mixed,
)

from strata.model.loader import LoadedModel
from strata.protocol.pd import KV_PATH, LAYOUT_PATH

LONG = ("the weather in the north was cold and wet all week, so the school closed early and "
        "every student stayed home with a book and a cup of tea while the rain fell")
PROMPTS = ["hello there", LONG[:70], LONG]
SAMPLING = [{"temperature": 0}, {"temperature": 0.9, "seed": 11, "top_p": 0.95}]


@pytest.fixture(scope="module")
def trio(tiny_model: LoadedModel) -> Iterator[dict[str, Instance]]:
    fleet = {"p": start_instance(tiny_model), "d": start_instance(tiny_model),
             "m": start_instance(tiny_model)}
    yield fleet
    for instance in fleet.values():
        instance.stop()


def body_of(content: str, n: int = 0, **sampling: Any) -> dict[str, Any]:
    """A fresh prompt for each `n`, from its first block on, so no instance has any of it
    cached (cached_tokens and the KV of a prefix hit depend on what an instance saw before)."""
    unique = hashlib.blake2b(str(n).encode(), digest_size=8).hexdigest()
    return {"model": "tiny-llama",
            "messages": [{"role": "user", "content": f"{unique} {content}"}],
            "max_tokens": 10, "ignore_eos": True, "logprobs": True, "top_logprobs": 2,
            **sampling}


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "medium", "long"])
def test_decode_after_a_pull_answers_as_a_mixed_instance(trio: dict[str, Instance], prompt: str,
                                                        sampling: dict[str, Any]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = body_of(prompt, n=len(prompt) + len(sampling), **sampling)
    expected = mixed(m, body).json()
    pulled_before = d.metric("pd_handoffs_total", side="decode", outcome="pulled")
    answer = decode(d, body, prefill(p, body))
    assert answer.status_code == 200, answer.text
    assert comparable(answer.json()) == comparable(expected)
    assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") == pulled_before + 1
    assert wait_until(lambda: p.num_held_blocks == 0)  # acknowledged: back in P's free pool


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_streamed_decode_after_a_pull_sends_the_mixed_frames(trio: dict[str, Instance],
                                                             sampling: dict[str, Any]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = {**body_of(LONG, n=100 + len(sampling), **sampling),
            "stream": True, "stream_options": {"include_usage": True}}
    expected = [comparable(e) for e in stream_mixed(m, body)]
    handle = prefill(p, body)
    assert [comparable(e) for e in stream_decode(d, body, handle)] == expected
    assert wait_until(lambda: p.num_held_blocks == 0)


def test_completions_hand_off_too(trio: dict[str, Instance]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = {"model": "tiny-llama", "prompt": "completions: " + LONG, "max_tokens": 6,
            "temperature": 0, "logprobs": 2}
    path = "/v1/completions"
    answer = decode(d, body, prefill(p, body, path), path)
    assert comparable(answer.json()) == comparable(mixed(m, body, path).json())


def test_the_prefill_side_cached_tokens_are_what_usage_reports(
        trio: dict[str, Instance]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = body_of(LONG, n=200, temperature=0)
    mixed(m, body)  # now cached on m; on p once p has prefilled it
    decode(d, body, prefill(p, body))
    again_mixed = mixed(m, body).json()
    again = decode(d, body, prefill(p, body)).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % BLOCK == 0
    assert comparable(again) == comparable(again_mixed)


def test_blocks_d_has_cached_are_not_pulled(trio: dict[str, Instance]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = body_of(LONG, n=300, temperature=0)
    before = d.metric("pd_pull_bytes_total", side="decode")
    handle = prefill(p, body)
    decode(d, body, handle)
    received = d.metric("pd_pull_bytes_total", side="decode")
    block_bytes = (received - before) / json.loads(handle)["num_blocks"]
    second = decode(d, body, prefill(p, body)).json()
    # the full blocks are local hits now: only the partial last block, never cached, is pulled
    assert d.metric("pd_pull_bytes_total", side="decode") == received + block_bytes
    mixed(m, body)
    assert comparable(second) == comparable(mixed(m, body).json())  # both with a prefix hit


def test_a_handle_for_another_prompt_is_ignored(trio: dict[str, Instance]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = body_of(LONG, n=400, temperature=0)
    other = body_of(LONG, n=401, temperature=0)
    local_before = d.metric("pd_handoffs_total", side="decode", outcome="local")
    answer = decode(d, body, prefill(p, other))
    assert comparable(answer.json()) == comparable(mixed(m, body).json())
    assert d.metric("pd_handoffs_total", side="decode", outcome="local") == local_before + 1
    assert wait_until(lambda: p.num_held_blocks == 0)  # D let P free what it cannot use


def test_a_stale_handle_still_hands_over_the_first_token(trio: dict[str, Instance]) -> None:
    p, d, m = trio["p"], trio["d"], trio["m"]
    body = body_of(LONG, n=500, temperature=0)
    handle = prefill(p, body)
    url = f"{p.url}{KV_PATH}/{json.loads(handle)['handle']}"
    assert httpx.delete(url, headers=FLEET).status_code == 204
    assert httpx.delete(url, headers=FLEET).status_code == 404
    assert httpx.get(url, headers=FLEET).status_code == 404
    unavailable = d.metric("pd_blocks_recomputed_total", reason="unavailable")
    answer = decode(d, body, handle)
    assert comparable(answer.json()) == comparable(mixed(m, body).json())
    assert d.metric("pd_blocks_recomputed_total", reason="unavailable") > unavailable


def test_layout_names_what_the_bytes_depend_on(trio: dict[str, Instance]) -> None:
    layout = httpx.get(trio["p"].url + LAYOUT_PATH, headers=FLEET).json()
    assert {k: layout[k] for k in ("model", "version", "dtype", "block_size", "num_layers",
                                   "namespace", "parallel")} == {
        "model": "tiny-llama", "version": "v1", "dtype": "float32", "block_size": BLOCK,
        "num_layers": 2, "namespace": "tiny-llama@v1",
        "parallel": {"name": "tp1", "tensor_size": 1, "pipeline_size": 1,
                     "kv_heads_per_rank": [[0, 2]], "layers_per_stage": [[0, 2]]}}
    other = httpx.get(trio["d"].url + LAYOUT_PATH, headers=FLEET).json()
    assert layout["epoch"] != other["epoch"]


def test_a_malformed_handle_is_a_400(trio: dict[str, Instance]) -> None:
    answer = decode(trio["d"], body_of("x", temperature=0), "{not json")
    assert answer.status_code == 400
    assert "hand-off handle" in answer.json()["error"]["message"]


def test_prefill_refuses_what_a_mixed_instance_refuses(trio: dict[str, Instance]) -> None:
    body = {**body_of(LONG, temperature=0), "max_tokens": 10_000}
    response = httpx.post(f"{trio['p'].url}/internal/prefill/v1/chat/completions", json=body,
                          headers=FLEET)
    assert response.status_code == mixed(trio["m"], body).status_code == 400
    many = httpx.post(f"{trio['p'].url}/internal/prefill/v1/chat/completions",
                      json={**body_of("x", temperature=0), "n": 2}, headers=FLEET)
    assert many.status_code == 400 and trio["p"].num_held_blocks == 0
