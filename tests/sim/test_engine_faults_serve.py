"""One request never kills an instance, through a real `strata serve --simulate` process whose
profile injects executor faults (strata/sim/faults.py): a request the executor cannot run fails
alone, and an executor that can run nothing makes the process exit with status 3."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
from serve_process import ServeProcess, start_serve

from strata.commands.serve_stack import ENGINE_DIED_EXIT_STATUS
from strata.protocol.sse import DONE, SSEParser
from strata.sim.faults import SimFaults
from strata.sim.profile import LatencyProfile

POISON_SEED = 666


def profile_with(faults: SimFaults, path: Path) -> Path:
    LatencyProfile(model="faulty", source="synthetic", prefill_ms_base=2.0,
                   prefill_ms_per_token=0.0, decode_ms_base=20.0, decode_ms_per_seq=0.0,
                   faults=faults).save(path)
    return path


def chat(seed: int | None = None, *, stream: bool, max_tokens: int = 8) -> dict[str, object]:
    body: dict[str, object] = {"messages": [{"role": "user", "content": "hello there"}],
                               "max_tokens": max_tokens, "stream": stream}
    if seed is not None:
        body["seed"] = seed
    return body


async def stream_events(client: httpx.AsyncClient, url: str,
                        body: dict[str, object]) -> list[object]:
    """Every SSE data payload of one streamed chat completion, decoded ([DONE] as is)."""
    parser, events = SSEParser(), []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_bytes():
            events += [e if e == DONE else json.loads(e) for e in parser.feed(chunk)]
    return events


def finish_reasons(events: list[object]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict)
            for c in e.get("choices", []) if c.get("finish_reason")]


def serve(tmp_path: Path, faults: SimFaults) -> ServeProcess:
    profile = profile_with(faults, tmp_path / "faulty.json")
    return start_serve(["--simulate", str(profile)], cache_dir=tmp_path / "cache", timeout_s=60,
                       log_dir=tmp_path / "logs")


def test_a_poisoned_request_fails_alone_and_the_instance_serves_on(tmp_path: Path) -> None:
    server = serve(tmp_path, SimFaults(poison_seed=POISON_SEED))
    try:
        async def both() -> tuple[list[object], list[object]]:
            async with httpx.AsyncClient(timeout=30) as client:
                poisoned, healthy = await asyncio.gather(
                    stream_events(client, server.url, chat(POISON_SEED, stream=True)),
                    stream_events(client, server.url, chat(1, stream=True, max_tokens=20)))
                return poisoned, healthy

        poisoned, healthy = asyncio.run(both())
        assert finish_reasons(poisoned) == ["error"]
        assert poisoned[-1] == DONE
        error = poisoned[-2]
        assert isinstance(error, dict) and error["error"]["type"] == "internal_server_error"
        assert finish_reasons(healthy) == ["length"] and healthy[-1] == DONE
        answer = httpx.post(f"{server.url}/v1/chat/completions",
                            json=chat(POISON_SEED, stream=False), timeout=30)
        assert answer.status_code == 500
        assert "failed alone" in answer.json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        ok = httpx.post(f"{server.url}/v1/chat/completions", json=chat(2, stream=False),
                        timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_an_executor_that_can_run_nothing_ends_the_process_with_status_3(
        tmp_path: Path) -> None:
    server = serve(tmp_path, SimFaults(fail_from_step=3))
    try:
        async def two_streams() -> list[list[object]]:
            async with httpx.AsyncClient(timeout=30) as client:
                return list(await asyncio.gather(
                    *(stream_events(client, server.url, chat(stream=True, max_tokens=50))
                      for _ in range(2))))

        for events in asyncio.run(two_streams()):
            assert finish_reasons(events) == ["error"]
            assert isinstance(events[-2], dict) and "error" in events[-2]
            assert events[-1] == DONE
        assert server.proc.wait(timeout=30) == ENGINE_DIED_EXIT_STATUS
        assert "the engine died" in server.process.output()
    finally:
        server.stop()
