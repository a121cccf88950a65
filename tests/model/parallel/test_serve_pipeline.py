"""`strata serve --pipeline-parallel-size 2` as a real subprocess: each stage's busy fraction and
rank 0's communication per step on /metrics after concurrent traffic; a rank SIGKILLed while
batches are in flight ends every stream with an error event and [DONE], and the process exits 1
(so that its launcher restarts the instance whole)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from model.parallel.parallel_helpers import make_nine_head_model, rank_processes
from serve_process import ServeProcess, start_serve

from strata.commands.serve_stack import ENGINE_DIED_EXIT_STATUS

pytestmark = pytest.mark.needs("shm")
MODEL = "tiny-nine"


@pytest.fixture(scope="module")
def pp2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    model_dir = make_nine_head_model(tmp_path_factory.mktemp("serve") / MODEL)
    server = start_serve([str(model_dir), "--pipeline-parallel-size", "2", "--dtype", "float32",
                          "--kv-cache-gb", "0.01", "--log-level", "warning"],
                         cache_dir=tmp_path_factory.mktemp("cache"), timeout_s=300)
    yield server
    server.stop()


def metric_values(url: str, prefix: str) -> dict[str, float]:
    body = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line.startswith(prefix)}


def completions(url: str, num: int, max_tokens: int) -> list[dict]:
    """`num` concurrent completions; their bodies."""
    bodies: list[dict] = [{} for _ in range(num)]

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": f"story number {i}", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        bodies[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return bodies


def test_metrics_show_each_stage_busy_and_the_communication_per_step(
        pp2_server: ServeProcess) -> None:
    bodies = completions(pp2_server.url, 4, 24)
    assert [b["usage"]["completion_tokens"] for b in bodies] == [24] * 4
    busy = metric_values(pp2_server.url, "strata:stage_busy")
    for stage in ("0", "1"):
        labels = f'{{model_name="{MODEL}",stage="{stage}"}}'
        assert 0 < busy[f"strata:stage_busy_fraction{labels}"] <= 1
        assert busy[f"strata:stage_busy_seconds_total{labels}"] > 0
    comm = metric_values(pp2_server.url, "strata:")
    assert comm[f'strata:parallel_comm_seconds_total{{model_name="{MODEL}"}}'] > 0
    assert comm[f'strata:step_comm_seconds{{model_name="{MODEL}"}}'] >= 0
    # nothing ran since the last scrape: idle stages are 0 busy, not undefined
    again = metric_values(pp2_server.url, "strata:stage_busy_fraction")
    assert set(again.values()) == {0.0}


def test_a_rank_killed_with_batches_in_flight_ends_every_stream_and_the_process(
        pp2_server: ServeProcess) -> None:
    """Last in this module: it ends the shared server. Three streams decode at once, so the
    engine keeps two batches in flight; rank 1 (stage 1, which samples) is killed."""
    (rank_1,) = rank_processes(pp2_server.proc.pid)
    events: list[list[str]] = [[] for _ in range(3)]
    started = [threading.Event() for _ in range(3)]
    ended_at = [0.0] * 3

    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"once upon a time {i}", "max_tokens": 200,
                "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{pp2_server.url}/v1/completions", json=body,
                          timeout=30) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line.removeprefix("data: "))
                    started[i].set()
        ended_at[i] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    os.kill(rank_1, signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(30)
    for got in events:
        assert got[-1] == "[DONE]"
        error_event, last = json.loads(got[-2]), json.loads(got[-3])
        assert "error" in error_event, got[-4:]  # the finish chunk, an error event, [DONE]
        assert last["choices"][0]["finish_reason"] == "error", got[-4:]
        assert 2 < len(got) < 200  # it stopped early, after some tokens
    assert max(ended_at) - killed_at < 2.0
    assert pp2_server.proc.wait(timeout=60) == ENGINE_DIED_EXIT_STATUS
