"""logit_bias, min_tokens and the penalties through the wire, with the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, live: LiveServer) -> None:
    forced = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=4,
                                       temperature=0.0, logit_bias={"97": 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "aaaa"  # token 97 is the byte "a"
    vocab = live.engine.vocab_size
    assert vocab is not None
    banned = {str(t): -100 for t in range(vocab) if t not in (97, 98)}
    for seed in range(3):
        r = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=8,
                                      temperature=1.0, seed=seed, logit_bias=banned)
        assert set(r.choices[0].text) <= {"a", "b"} and len(r.choices[0].text) == 8


def test_min_tokens_holds_back_a_forced_eos(client: openai.OpenAI, live: LiveServer) -> None:
    eos = live.engine.decoder.eos_token_ids[0]  # type: ignore[attr-defined]
    r = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=20,
                                  temperature=0.0, logit_bias={str(eos): 100},
                                  extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 6  # five, then EOS


def test_repetition_penalty_changes_a_repetitive_greedy_answer(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL_NAME, prompt="the the the", max_tokens=12,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    penalised = client.completions.create(
        model=MODEL_NAME, prompt="the the the", max_tokens=12, temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 2.0})
    assert penalised.choices[0].text != plain.choices[0].text


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": 30, "max_tokens": 10}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_values_are_400_naming_the_field(live: LiveServer, body: dict[str, object],
                                             param: str) -> None:
    r = httpx.post(f"{live.v1}/completions", json={"prompt": "x", "max_tokens": 10} | body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
