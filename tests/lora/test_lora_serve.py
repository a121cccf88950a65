"""`strata serve --lora-modules` as a real process, called with the official `openai` client.

Completions and chat with `model: <adapter>` give HF+PEFT's greedy tokens, requests on the base
and on both adapters in flight at once included; /v1/models lists the adapters with their
parent, every card `deterministic` (served with --deterministic: float32 weights run torch's
matmuls, so the tokens are the same as without); an unknown model keeps its 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from lora_fixtures import hf_greedy, make_models
from resume_streams import frames_of
from serve_process import ServeProcess, start_serve

from strata.protocol.resume import RESUMABLE_HEADER, RESUME_PATH

N = 6
MARKED = {RESUMABLE_HEADER: "1"}
PROMPT = [(7 * i + 3) % 250 for i in range(13)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("lora-serve"))


@pytest.fixture(scope="module")
def server(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServeProcess]:
    proc = start_serve([str(paths["base"]), "--served-model-name", "tiny", "--dtype", "float32",
                        "--block-size", "4", "--kv-cache-gb", "0.01", "--deterministic",
                        "--lora-modules", f"lora-a={paths['a']}", f"lora-b={paths['b']}"],
                       cache_dir=tmp_path_factory.mktemp("cache"), timeout_s=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_adapters_match_hf_peft_alone_and_in_flight_together(
        client: openai.OpenAI, paths: dict[str, Path]) -> None:
    models = {"tiny": None, "lora-a": paths["a"], "lora-b": paths["b"]}
    want = {m: hf_greedy(paths["base"], p, PROMPT, N) for m, p in models.items()}
    assert len({tuple(t) for t in want.values()}) == 3  # three different answers
    got = {m: _text(client, m) for m in models}
    with ThreadPoolExecutor(6) as pool:
        mixed = list(pool.map(lambda m: (m, _text(client, m)), [*models, *models]))
    for m, text in [*got.items(), *mixed]:
        assert text == _decode(client, want[m]), m


def _text(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert r.model == model
    return r.choices[0].text


def _decode(client: openai.OpenAI, tokens: list[int]) -> str:
    import httpx

    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    r = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": tokens})
    r.raise_for_status()
    return str(r.json()["prompt"])


def test_chat_with_an_adapter_differs_from_the_base(client: openai.OpenAI) -> None:
    def ask(model: str) -> str:
        r = client.chat.completions.create(model=model, max_tokens=N, temperature=0.0,
                                           messages=[{"role": "user", "content": "hello"}],
                                           extra_body={"ignore_eos": True})
        assert r.model == model
        return r.choices[0].message.content or ""
    base, a = ask("tiny"), ask("lora-a")
    assert base != a and a == ask("lora-a")


def test_models_lists_the_adapters_with_their_parent(client: openai.OpenAI) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {"tiny", "lora-a", "lora-b"}
    assert cards["lora-a"]["parent"] == cards["lora-b"]["parent"] == "tiny"
    assert "parent" not in cards["tiny"]
    assert [c["deterministic"] for c in cards.values()] == [True] * 3  # --deterministic


def test_an_unknown_model_is_still_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="lora-c"):
        client.completions.create(model="lora-c", prompt="x", max_tokens=1)


def test_a_resumed_adapter_stream_goes_on_with_the_adapter(
        server: ServeProcess, paths: dict[str, Path]) -> None:
    """POST /v1/strata/resume of a stream on lora-a, cut after two tokens: the rest are the
    adapter's tokens (before, the resumed request ran on the base weights)."""
    want = hf_greedy(paths["base"], paths["a"], PROMPT, N)
    assert want != hf_greedy(paths["base"], None, PROMPT, N)  # else this proves nothing
    body = {"model": "lora-a", "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    first = httpx.post(f"{server.url}/v1/completions", json=body, headers=MARKED, timeout=60)
    started = frames_of(first.content)
    assert [t for f in started for t in f.token_ids] == want
    start = started[0].marks[0]
    resumed = httpx.post(f"{server.url}{RESUME_PATH}", headers=MARKED, timeout=60, json={
        "path": "/v1/completions", "request": body, "id": start["id"],
        "created": start["created"], "version": start["version"],
        "prompt_token_ids": PROMPT, "output_token_ids": want[:2]})
    assert resumed.status_code == 200, resumed.text
    assert want[:2] + [t for f in frames_of(resumed.content) for t in f.token_ids] == want
