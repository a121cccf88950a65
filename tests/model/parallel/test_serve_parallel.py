"""`strata serve --tensor-parallel-size 2` as a real subprocess: the `openai` client against it,
per-rank memory on /metrics, and a rank SIGKILLed mid-stream (the stream ends with an error
event and [DONE], the process exits non-zero)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from model.parallel.parallel_helpers import make_nine_head_model, rank_processes
from openai import OpenAI
from serve_process import ServeProcess, start_serve

from strata.commands.serve_stack import ENGINE_DIED_EXIT_STATUS
from strata.model.parallel.shm import SHM_DIR

pytestmark = pytest.mark.needs("shm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_nine_head_model(tmp_path_factory.mktemp("serve") / "tiny-nine")


def serve_t2(model_dir: Path, cache_dir: Path) -> ServeProcess:
    return start_serve([str(model_dir), "--tensor-parallel-size", "2", "--dtype", "float32",
                        "--kv-cache-gb", "0.01", "--log-level", "warning"],
                       cache_dir=cache_dir, timeout_s=300)


@pytest.fixture(scope="module")
def t2_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[ServeProcess]:
    server = serve_t2(model_dir, tmp_path_factory.mktemp("cache"))
    yield server
    server.stop()


def test_the_openai_client_against_a_t2_instance(t2_server: ServeProcess) -> None:
    client = OpenAI(base_url=f"{t2_server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny-nine"]
    messages = [{"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model="tiny-nine", messages=messages,  # type: ignore
                                           max_tokens=12, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="tiny-nine", messages=messages,  # type: ignore
                                            max_tokens=12, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == reply.choices[0].message.content  # greedy: streamed or not, the same


def test_metrics_report_each_ranks_weights_and_kv(t2_server: ServeProcess) -> None:
    body = httpx.get(f"{t2_server.url}/metrics", timeout=10).text
    values = {}
    for line in body.splitlines():
        if line.startswith("strata:rank_"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for rank in ("0", "1"):
        assert values[f'strata:rank_weight_bytes{{model_name="tiny-nine",rank="{rank}"}}'] > 0
        assert values[f'strata:rank_kv_bytes{{model_name="tiny-nine",rank="{rank}"}}'] > 0


def test_a_rank_killed_mid_stream_ends_the_stream_and_the_process(
        model_dir: Path, tmp_path: Path) -> None:
    server = serve_t2(model_dir, tmp_path / "cache")
    try:
        (rank_1,) = rank_processes(server.proc.pid)
        body = {"model": "tiny-nine", "prompt": "once upon a time", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        events: list[str] = []
        killed_at = 0.0
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 1:
                    os.kill(rank_1, signal.SIGKILL)
                    killed_at = time.monotonic()
        ended_at = time.monotonic()
        assert events[-1] == "[DONE]"
        error_event, last = json.loads(events[-2]), json.loads(events[-3])
        assert "error" in error_event, events[-4:]  # the finish chunk, an error event, [DONE]
        assert last["choices"][0]["finish_reason"] == "error", events[-4:]
        assert 3 < len(events) < 200  # it stopped early, after some tokens
        # found as a death (by the watch on its process, or by rank 0 through the shared
        # memory group), never by a collective timing out (60 s)
        message = error_event["error"]["message"]
        assert "RankFailedError: rank 1 " in message, message
        assert "did not reach the collective" not in message, message
        # bench/fault_detection.py measures kill -> end of stream; 10 s keeps 5x headroom over
        # the 2 s that docs/reliability.md promises
        assert ended_at - killed_at < 10.0
        assert server.proc.wait(timeout=60) != 0
    finally:
        server.stop()


def test_sigterm_stops_every_rank_and_exits_0(model_dir: Path, tmp_path: Path) -> None:
    server = serve_t2(model_dir, tmp_path / "cache")
    try:
        (rank_1,) = rank_processes(server.proc.pid)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert not Path(f"/proc/{rank_1}").exists()
        assert not list(SHM_DIR.glob(f"strata-{server.proc.pid}-*"))
    finally:
        server.stop()


def test_a_rank_that_dies_while_idle_ends_the_process(t2_server: ServeProcess) -> None:
    """Last in this module: it ends the shared server."""
    (rank_1,) = rank_processes(t2_server.proc.pid)
    os.kill(rank_1, signal.SIGKILL)
    killed_at = time.monotonic()
    assert t2_server.proc.wait(timeout=60) == ENGINE_DIED_EXIT_STATUS  # its launcher restarts it
    assert time.monotonic() - killed_at < 10
