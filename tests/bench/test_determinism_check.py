"""`strata bench --check-determinism`: the cells it reports follow what the server does (fake
servers whose answers change with the cache or with the batch), and against a real `strata serve`
of a tiny float32 model every answer is identical."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import ServeProcess, start_serve
from tiny_models import make_tiny_model_dir

from strata.bench.determinism import DeterminismConfig, check_determinism, format_determinism

CONFIG = DeterminismConfig(url="http://fake", model="m", num_prompts=5, batch_size=8,
                           output_len=4, show_progress=False)


class FakeServer:
    """Answers a chat with its prompt's hash, changed by what `vary` says about the request."""

    def __init__(self, vary: str) -> None:
        self.vary = vary
        self.seen: set[str] = set()
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        prompt = body["messages"][0]["content"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        busy = self.in_flight
        await asyncio.sleep(0.01)  # the batch's requests overlap
        text = f"{hash(prompt) % 997} seed {body.get('seed')}"
        if self.vary == "cache" and prompt in self.seen:
            text += " (from the cache)"
        if self.vary == "batch" and max(busy, self.in_flight) > 1:
            text += " (in a batch)"
        if self.vary == "error" and "-1]" in prompt.split()[0] and prompt in self.seen:
            self.in_flight -= 1  # prompt 1 of each mode fails after its first answer
            return httpx.Response(500, json={"error": {"message": "boom"}})
        self.seen.add(prompt)
        self.in_flight -= 1
        return httpx.Response(200, json={"choices": [
            {"message": {"role": "assistant", "content": text}, "finish_reason": "length"}]})

def run_check(server: FakeServer) -> dict[str, Any]:
    return asyncio.run(check_determinism(CONFIG, transport=httpx.MockTransport(server.handle)))


def cells(report: dict[str, Any]) -> dict[tuple[str, str], int]:
    return {(mode, name): cell["identical"] for mode, row in report["cells"].items()
            for name, cell in row.items()}


def test_a_server_that_answers_alike_reads_identical_everywhere() -> None:
    server = FakeServer("none")
    report = run_check(server)
    assert set(cells(report).values()) == {5} and report["all_identical"]
    assert report["errors"] == []
    # each mode: 5 alone, 5 alone again, then a batch of 8 at once (5 prompts + 3 fillers)
    assert len(server.bodies) == CONFIG.num_requests == 2 * (5 + 5 + 8)
    assert server.max_in_flight == 8
    greedy, seeded = server.bodies[:18], server.bodies[18:]
    assert all(b["temperature"] == 0 and "seed" not in b for b in greedy)
    assert all(b["temperature"] == 0.9 and b["top_p"] == 0.95 for b in seeded)
    assert [b["seed"] for b in seeded[:5]] == [b["seed"] for b in seeded[5:10]]


def test_a_cache_that_changes_answers_shows_in_the_cached_cell_only() -> None:
    report = run_check(FakeServer("cache"))
    found = cells(report)
    assert found[("greedy", "cached vs uncached")] == 0
    assert found[("seeded", "cached vs uncached")] == 0
    # the batch is sent after the prompts are cached: it matches the cached answers
    assert found[("greedy", "batched vs cached")] == 5 and not report["all_identical"]
    table = format_determinism(report)
    assert "cached vs uncached" in table and "0 / 5" in table and "5 / 5" in table


def test_a_batch_that_changes_answers_shows_in_the_batched_cell_only() -> None:
    found = cells(run_check(FakeServer("batch")))
    assert found[("greedy", "batched vs cached")] == 0
    assert found[("seeded", "batched vs cached")] == 0
    assert found[("greedy", "cached vs uncached")] == 5


def test_a_failed_request_counts_as_not_identical_and_is_reported() -> None:
    report = run_check(FakeServer("error"))
    assert report["errors"] and report["errors"][0].startswith("500")
    assert report["cells"]["greedy"]["cached vs uncached"]["differing"] == [1]
    assert report["cells"]["seeded"]["batched vs cached"]["differing"] == [1]
    assert len(report["errors"]) == 4  # prompt 1 cached and batched, in both modes
    assert not report["all_identical"]


@pytest.fixture(scope="module")
def tiny_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("determinism")
    model = make_tiny_model_dir(root / "tiny", seed=3, initializer_range=0.2)
    (root / "keys").write_text("k-bench\n")
    server = start_serve([str(model), "--served-model-name", "tiny", "--dtype", "float32",
                          "--threads", "1", "--max-model-len", "512", "--log-level", "warning",
                          "--api-key-file", str(root / "keys")], cache_dir=root / "cache",
                         timeout_s=120)
    try:
        yield server
    finally:
        server.stop()


def test_a_real_float32_instance_answers_identically_alone_cached_and_batched(
        tiny_serve: ServeProcess, tmp_path: Path) -> None:
    out = tmp_path / "determinism.json"
    done = subprocess.run(
        [sys.executable, "-m", "strata.cli", "bench", "--url", tiny_serve.url,
         "--check-determinism", "--num-requests", "6", "--batch-size", "12", "--output-len",
         "16", "--api-key", "k-bench", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["model"] == "tiny" and report["errors"] == []
    assert all(cell == {"identical": 6, "total": 6, "differing": []}
               for row in report["cells"].values() for cell in row.values())
    assert "k-bench" not in out.read_text()  # the key is not written into the report
    assert "batched vs cached" in done.stdout


def test_the_check_without_the_key_names_the_refusal(tiny_serve: ServeProcess) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_API_KEY")}
    done = subprocess.run(
        [sys.executable, "-m", "strata.cli", "bench", "--url", tiny_serve.url,
         "--check-determinism", "--num-requests", "1", "--no-progress"],
        capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    assert "/v1/models answered 401" in done.stderr and "--api-key" in done.stderr
