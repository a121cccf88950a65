"""A request one rank of a T=2 instance cannot run fails alone, through the OpenAI API on a real
socket: the rank makes the collectives it still owes, rank 0 voids the step and the engine
bisects it, so the request ends with finish_reason "error" while a concurrent request gets the
tokens a T=1 instance gives and the instance serves on. A rank whose replay fails too cannot go
on: the engine dies (the process would exit 3 and be restarted).

The ranks are made to fail by test-only faults (strata/model/parallel/share.py) keyed on token
ids that no other prompt or answer here holds."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from model.parallel.parallel_helpers import make_engine, rank_processes
from openai import OpenAI
from server.live_server import serve_in_thread, wait_until

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelExecutor
from strata.engine.request import Request, SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.model.parallel.executor import ParallelExecutor
from strata.model.parallel.layout import ParallelLayout
from strata.model.parallel.shard_loader import PreparedModel
from strata.model.parallel.share import ShareFault
from strata.model.parallel.shm import SHM_DIR
from strata.protocol.sse import DONE, SSEParser
from strata.server.app import create_app
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.types import RequestId

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")

MODEL = "tiny-nine"
PROMPTS = [[(7 * i + 11) % 200 for i in range(30)], [(13 * i + 5) % 200 for i in range(9)]]
MAX_TOKENS = 24
# where the faults trip: before rank 1's forward, at rank 1's third collective (the embedding's
# sum and layer 0's attention sum made), at rank 0's second, and one whose replay fails too
WHERE = {"rank1-before": (1, 0, False), "rank1-mid": (1, 3, False), "rank0-mid": (0, 2, False),
         "rank1-fatal": (1, 2, True)}


@dataclass
class Served:
    url: str
    async_engine: AsyncEngine
    server: uvicorn.Server
    thread: Any

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(executor: ModelExecutor, loaded: LoadedModel) -> Served:
    engine = Engine(executor, CacheConfig(block_size=4, num_blocks=128),
                    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128,
                                    max_model_len=128),
                    loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    async_engine = AsyncEngine(engine, max_model_len=128)
    app = create_app(async_engine, loaded.tokenizer, ServerConfig(served_model_name=MODEL))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, thread = serve_in_thread(app, sock)
    return Served(f"http://127.0.0.1:{sock.getsockname()[1]}", async_engine, server, thread)


def body(prompt: list[int], *, stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, dtype="float32")


@pytest.fixture(scope="module")
def answers(loaded: LoadedModel) -> list[dict[str, Any]]:
    """What one T=1 instance answers to `PROMPTS` (float32)."""
    t1 = serve(TorchExecutor(loaded.config, loaded.weights, dtype="float32"), loaded)
    try:
        return [httpx.post(f"{t1.url}/v1/completions", json=body(p, stream=False),
                           timeout=60).json() for p in PROMPTS]
    finally:
        t1.stop()


@pytest.fixture(scope="module")
def poison(loaded: LoadedModel) -> dict[str, int]:
    """A token id per fault that no prompt or greedy answer here holds."""
    engine = make_engine(TorchExecutor(loaded.config, loaded.weights, dtype="float32"),
                         loaded.config.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(RequestId(f"ref{i}"), list(prompt), params))
    used = {t for p in PROMPTS for t in p}
    while engine.has_unfinished_requests():
        used |= {t for out in engine.step() for t in out.new_token_ids}
    free = [t for t in range(loaded.config.vocab_size - 1, 0, -1) if t not in used]
    return dict(zip(WHERE, free, strict=False))


@pytest.fixture(scope="module")
def t2(prepared: PreparedModel, loaded: LoadedModel, poison: dict[str, int]
       ) -> Iterator[Served]:
    faults = tuple(ShareFault(rank, poison[name], at_call=at, is_fatal=fatal)
                   for name, (rank, at, fatal) in WHERE.items())
    executor = ParallelExecutor(prepared, ParallelLayout(tensor_size=2), dtype="float32",
                                model_name=MODEL, timeout_s=60, faults=faults)
    served = serve(executor, loaded)
    yield served
    served.stop()
    executor.shutdown()


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int]) -> list[Any]:
    """Every SSE payload of a streamed completion, decoded ([DONE] as is)."""
    parser, events = SSEParser(), []
    async with client.stream("POST", f"{url}/v1/completions",
                             json=body(prompt, stream=True)) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_bytes():
            events += [e if e == DONE else json.loads(e) for e in parser.feed(chunk)]
    return events


def finish_reasons(events: list[Any]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict)
            for c in e.get("choices", []) if c.get("finish_reason")]


def text(events: list[Any]) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict)
                   for c in e.get("choices", []))


def poisoned_and_healthy(served: Served, prompt: list[int]) -> tuple[list[Any], list[Any]]:
    async def both() -> tuple[list[Any], list[Any]]:
        async with httpx.AsyncClient(timeout=60) as client:
            poisoned, healthy = await asyncio.gather(stream(client, served.url, prompt),
                                                     stream(client, served.url, PROMPTS[0]))
        return poisoned, healthy

    return asyncio.run(both())


@pytest.mark.parametrize("where", ["rank1-before", "rank1-mid", "rank0-mid"])
def test_a_request_one_rank_cannot_run_fails_alone(
        t2: Served, poison: dict[str, int], answers: list[dict[str, Any]], where: str) -> None:
    prompt = [*PROMPTS[1][:4], poison[where], *PROMPTS[1][4:]]
    poisoned, healthy = poisoned_and_healthy(t2, prompt)
    assert finish_reasons(poisoned) == ["error"] and poisoned[-1] == DONE
    assert isinstance(poisoned[-2], dict) and "error" in poisoned[-2]
    assert finish_reasons(healthy) == ["length"]
    assert text(healthy) == answers[0]["choices"][0]["text"]  # as one T=1 instance answers
    client = OpenAI(base_url=f"{t2.url}/v1", api_key="unused")
    again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == answers[1]["choices"][0]["text"]  # it serves on
    assert t2.async_engine.is_healthy


def test_a_rank_that_cannot_go_on_ends_the_instance(t2: Served, poison: dict[str, int]) -> None:
    """Last in this module: it ends the shared instance."""
    (rank_1,) = rank_processes(os.getpid())
    prompt = [*PROMPTS[1][:4], poison["rank1-fatal"], *PROMPTS[1][4:]]

    async def one() -> list[Any]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream(client, t2.url, prompt)

    assert finish_reasons(asyncio.run(one())) == ["error"]
    assert wait_until(lambda: not t2.async_engine.is_healthy)
    assert "RankFailedError" in (t2.async_engine.dead_reason or "")
    assert wait_until(lambda: not is_running(rank_1))  # the rank's process ended
    assert httpx.get(f"{t2.url}/health", timeout=10).status_code == 503


def is_running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
