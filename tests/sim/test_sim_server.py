"""A simulated instance behind the real HTTP app, used with the `openai` client; and the promise
that the simulated path never imports torch."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine

PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.2,
                         prefill_ms_per_token=0.001, decode_ms_base=0.5, decode_ms_per_seq=0.05)


@dataclass
class Live:
    url: str
    server: uvicorn.Server
    thread: threading.Thread


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    async_engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        PROFILE, max_num_seqs=8, kv_blocks=256, max_model_len=512))
    app = create_app(async_engine, tokenizer,
                     ServerConfig(served_model_name="sim-model", simulated=True))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the simulated server did not start"
    yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_completion_returns_max_tokens_words(client: openai.OpenAI) -> None:
    r = client.completions.create(model="sim-model", prompt="the world of", max_tokens=7,
                                  temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == 5  # "t", "h", "e", " world", " of"
    text = r.choices[0].text
    assert len(text.split()) == 7 and text.startswith(" ")
    again = client.completions.create(model="sim-model", prompt="the world of", max_tokens=7,
                                      temperature=0)
    assert again.choices[0].text == text  # greedy is deterministic


def test_chat_streams_chunk_by_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and
              c.choices[0].delta.content]
    assert len(deltas) == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    whole = client.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=5,
        seed=3)
    assert len((whole.choices[0].message.content or "").split()) == 5


def test_streamed_completion_with_stop_string(client: openai.OpenAI) -> None:
    full = client.completions.create(model="sim-model", prompt="a b", max_tokens=12, seed=1)
    words = full.choices[0].text.split()
    stop = " " + words[3]
    stopped = "".join(c.choices[0].text for c in client.completions.create(
        model="sim-model", prompt="a b", max_tokens=12, seed=1, stop=[stop], stream=True))
    assert stopped == full.choices[0].text[:full.choices[0].text.index(stop)]


def test_models_and_metrics_say_simulated(live: Live) -> None:
    card = httpx.get(f"{live.url}/v1/models").json()["data"][0]
    assert card["simulated"] is True
    assert card["owned_by"] == "strata-simulated"
    assert card["deterministic"] is False  # no matmul kernels to fix
    metrics = httpx.get(f"{live.url}/metrics").text
    assert "\nstrata:simulated 1.0\n" in metrics


def test_the_simulated_path_never_imports_torch() -> None:
    code = ("import strata.sim.server, strata.sim, strata.server.app, sys; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
