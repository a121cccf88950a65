"""The OpenAI API over real sockets, driven by the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MAX_MODEL_LEN, MODEL_NAME, LiveServer

GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def greedy_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                  extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].text


def test_completion_reports_text_usage_and_ids(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=7,
                                  extra_body=NO_EOS, **GREEDY)
    prompt_ids = httpx.post(f"{live.base_url}/tokenize", json={"prompt": "hello world"}).json()
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL_NAME
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_ids["count"], 7)
    assert r.usage.total_tokens == prompt_ids["count"] + 7
    assert r.choices[0].text == greedy_text(client, "hello world", 7)  # greedy is deterministic


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="the", extra_body=NO_EOS, **GREEDY)
    assert r.usage is not None and r.usage.completion_tokens == 16


def test_chat_default_max_tokens_is_the_rest_of_the_context(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, extra_body=NO_EOS, **GREEDY,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN


def test_streamed_completion_equals_the_full_one_and_ends_with_usage(
        client: openai.OpenAI) -> None:
    full = greedy_text(client, "the weather", 12)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="the weather", max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY))
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == full
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 12


def test_chat_and_stream_agree(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                       max_tokens=9, extra_body=NO_EOS, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=9, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and r.usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n2_gives_two_choices_and_counts_the_prompt_once(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, n=2, max_tokens=5, seed=3,
                                       messages=[{"role": "user", "content": "two"}],
                                       extra_body=NO_EOS)
    one = client.chat.completions.create(model=MODEL_NAME, max_tokens=5, seed=3,
                                         messages=[{"role": "user", "content": "two"}],
                                         extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 10
    assert r.choices[0].message.content == one.choices[0].message.content  # choice 0: seed 3


def test_stop_string_cuts_the_output_before_it(client: openai.OpenAI) -> None:
    full = greedy_text(client, "once upon", 24)
    stop = full[6:9]
    assert stop  # the tiny model produced enough text
    r = client.completions.create(model=MODEL_NAME, prompt="once upon", max_tokens=24,
                                  stop=[stop], extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="once upon", max_tokens=24,
                                            stop=stop, stream=True, extra_body=NO_EOS, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=5, logprobs=3,
                                  extra_body=NO_EOS, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs is not None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 3 and top for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # greedy: the chosen token is the most likely one
    assert [max(top.values()) for top in lp.top_logprobs] == pytest.approx(lp.token_logprobs)


def test_chat_logprobs_with_top_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, logprobs=True,
                                       top_logprobs=2, extra_body=NO_EOS, **GREEDY,
                                       messages=[{"role": "user", "content": "x"}])
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_seed_reproduces_sampling_over_http(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL_NAME, prompt="seeded", max_tokens=12,
                                      temperature=1.0, seed=seed, extra_body=NO_EOS)
        return r.choices[0].text

    assert sample(42) == sample(42)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [(m.id, m.owned_by, m.object) for m in models] == [(MODEL_NAME, "strata", "model")]


def test_tokenize_detokenize_roundtrip(live: LiveServer) -> None:
    text = "hello there, the world"
    tok = httpx.post(f"{live.base_url}/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{live.base_url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    chat = httpx.post(f"{live.base_url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = httpx.post(f"{live.base_url}/detokenize", json={"tokens": chat["tokens"]}).json()
    assert text["prompt"] == "user\nhi\nassistant\n"  # ChatML with its special tokens skipped


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_metrics_grow_after_a_request(client: openai.OpenAI, live: LiveServer) -> None:
    before = httpx.get(f"{live.base_url}/metrics").text
    for name in ("strata:time_to_first_token_seconds", "strata:time_per_output_token_seconds",
                 "strata:e2e_request_latency_seconds", "strata:num_requests_running",
                 "strata:num_requests_waiting", "strata:kv_cache_usage_ratio",
                 "strata:prefix_cache_hit_rate", "strata:prompt_tokens_total",
                 "strata:generation_tokens_total", "strata:num_preemptions_total",
                 "strata:request_success_total"):
        assert name in before
    client.completions.create(model=MODEL_NAME, prompt="count me", max_tokens=6,
                              extra_body=NO_EOS, **GREEDY)
    after = httpx.get(f"{live.base_url}/metrics").text
    grown = {n: _metric(after, n) - _metric(before, n) for n in (
        "strata:generation_tokens_total", "strata:e2e_request_latency_seconds_count",
        'strata:request_success_total{finish_reason="length"')}
    assert grown["strata:generation_tokens_total"] == 6
    assert grown["strata:e2e_request_latency_seconds_count"] == 1
    assert grown['strata:request_success_total{finish_reason="length"'] == 1


def test_health_and_ready(live: LiveServer) -> None:
    assert httpx.get(f"{live.base_url}/health").status_code == 200
    assert httpx.get(f"{live.base_url}/ready").status_code == 200
