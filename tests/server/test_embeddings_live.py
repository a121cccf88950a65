"""POST /v1/embeddings over real sockets on a tiny random BERT, driven by the official `openai`
client: floats and base64 equal HF's pooled embeddings, token-id inputs, usage, Matryoshka
`dimensions`, every bad input a 400 that names its field, and each task refusing the other's
routes."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from live_server import MODEL_NAME, LiveServer, start_embed_server
from tiny_bert import HIDDEN, MAX_POSITIONS, hf_embeddings, make_tiny_bert_dir

TEXTS = ["hello world", "Café crème brûlée, naïve résumé.", "the quick fox!", "中文 and 日本"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert_dir(tmp_path_factory.mktemp("embed") / "tiny-bert")


@pytest.fixture(scope="module")
def embed(bert_dir: Path) -> Iterator[LiveServer]:
    server = start_embed_server(bert_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(embed: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=embed.v1, api_key="unused", max_retries=0)


def test_float_embeddings_equal_hfs_and_report_usage(client: openai.OpenAI, bert_dir: Path,
                                                     embed: LiveServer) -> None:
    r = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == "tiny-bert"
    assert [d.index for d in r.data] == [0, 1, 2, 3] and r.data[0].object == "embedding"
    ours = torch.tensor([d.embedding for d in r.data])
    assert ours.shape == (len(TEXTS), HIDDEN)
    assert float((ours - hf_embeddings(bert_dir, TEXTS)).abs().max()) < 1e-5
    counts = [httpx.post(f"{embed.base_url}/tokenize", json={"prompt": t}).json()["count"]
              for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)


def test_base64_is_the_float32_bytes_of_the_same_vectors(client: openai.OpenAI,
                                                         embed: LiveServer) -> None:
    floats = client.embeddings.create(model="tiny-bert", input="hello world",
                                      encoding_format="float").data[0].embedding
    decoded = client.embeddings.create(model="tiny-bert", input="hello world").data[0].embedding
    assert decoded == pytest.approx(floats, abs=1e-7)  # the client asks base64 and decodes it
    raw = httpx.post(f"{embed.v1}/embeddings", json={"input": "hello world",
                                                     "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == pytest.approx(floats, abs=1e-7)


def test_each_input_is_a_finished_request_in_the_metrics(client: openai.OpenAI,
                                                        embed: LiveServer) -> None:
    def num_finished() -> float:
        text = httpx.get(f"{embed.base_url}/metrics").text
        line = next(x for x in text.splitlines()
                    if x.startswith("strata:request_success_total{") and 'reason="stop"' in x)
        return float(line.rsplit(" ", 1)[1])

    before = num_finished()
    client.embeddings.create(model="tiny-bert", input=["a", "b", "c"], extra_body={
        "priority": "batch"})
    assert num_finished() == before + 3


def test_token_id_inputs_embed_as_their_text_does(client: openai.OpenAI,
                                                  embed: LiveServer) -> None:
    ids = httpx.post(f"{embed.base_url}/tokenize", json={"prompt": "hello world"}).json()
    by_text = client.embeddings.create(input="hello world", model="tiny-bert",
                                       encoding_format="float")
    one = client.embeddings.create(input=ids["tokens"], model="tiny-bert",
                                   encoding_format="float")
    two = client.embeddings.create(input=[ids["tokens"], ids["tokens"][:2]], model="tiny-bert",
                                   encoding_format="float")
    assert one.data[0].embedding == pytest.approx(by_text.data[0].embedding, abs=1e-6)
    assert len(two.data) == 2 and two.usage.prompt_tokens == ids["count"] + 2


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": []}, "input", "non-empty"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["ok", ""]}, "input", "empty string"),
    ({"input": [1, "two"]}, "input", "not a mix"),
    ({"input": [[1, 2], []]}, "input", "non-empty lists"),
    ({"input": [True, False]}, "input", "non-negative integers"),
    ({"input": [1.5]}, "input", "token ids"),
    ({"input": {"text": "x"}}, "input", "must be"),
    ({}, "input", "must be"),
    ({"input": [10**6]}, "input", "token ids must be in"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "x", "dimensions": 8}, "dimensions", "Matryoshka"),
    ({"input": "x", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
    ({"input": "x", "truncate_prompt_tokens": 8}, None, "truncate_prompt_tokens is not supp"),
    ({"input": "x", "priority": "urgent-ish"}, "priority", "urgent-ish"),
])
def test_bad_inputs_are_400s_that_name_the_field(embed: LiveServer, body: dict[str, object],
                                                 param: str | None, says: str) -> None:
    r = httpx.post(f"{embed.v1}/embeddings", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_an_input_too_long_for_the_positions_is_a_400_naming_the_limit(
        client: openai.OpenAI) -> None:
    too_long = " ".join(["hello"] * MAX_POSITIONS)  # + [CLS] and [SEP]
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny-bert", input=["fine", too_long])
    assert f"maximum input length is {MAX_POSITIONS} tokens" in str(caught.value)
    assert "input[1] has 66 tokens" in str(caught.value)
    assert caught.value.code == "context_length_exceeded"


def test_matryoshka_dimensions_truncate_and_renormalize(tmp_path: Path) -> None:
    server = start_embed_server(make_tiny_bert_dir(tmp_path / "mrl",
                                                   matryoshka_dimensions=[8, 16]))
    try:
        c = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        full = c.embeddings.create(model="tiny-bert", input="hello world",
                                   encoding_format="float").data[0].embedding
        short = c.embeddings.create(model="tiny-bert", input="hello world", dimensions=8,
                                    encoding_format="float").data[0].embedding
        head = np.array(full[:8])
        assert short == pytest.approx((head / np.linalg.norm(head)).tolist(), abs=1e-6)
        with pytest.raises(openai.BadRequestError, match=r"one of \(8, 16\), got 9"):
            c.embeddings.create(model="tiny-bert", input="x", dimensions=9)
        models = httpx.get(f"{server.v1}/models").json()["data"][0]
        assert (models["task"], models["dimensions"]) == ("embed", HIDDEN)
        assert "deterministic" not in models  # a generate card's field only
    finally:
        server.stop()


def test_an_embed_instance_refuses_generation(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="for embeddings only"):
        client.completions.create(model="tiny-bert", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="for embeddings only"):
        client.chat.completions.create(model="tiny-bert", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    # nor does it prefill for a decode instance (the fuzzer found a 503 here)
    for path in ("/internal/prefill/v1/completions", "/internal/prefill/v1/chat/completions"):
        answer = httpx.post(f"{client.base_url}".removesuffix("/v1/") + path,
                            json={"prompt": ""}, timeout=10)
        assert answer.status_code == 400 and "for embeddings only" in answer.text, answer.text


def test_a_generate_instance_refuses_embeddings(live: LiveServer) -> None:
    c = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="needs an embedding model"):
        c.embeddings.create(model=MODEL_NAME, input="hello")
    assert httpx.get(f"{live.v1}/models").json()["data"][0]["task"] == "generate"
