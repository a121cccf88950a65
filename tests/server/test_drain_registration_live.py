"""A registered instance told to stop (SIGTERM, what its launcher sends when a release retires
its version) reports DRAINING to the registry at once, while a long stream still flows: uvicorn
closes its listener and waits for open connections before the app's shutdown, and meanwhile no
router or release controller may take it for a READY instance (a rollback would warm it and
fail). The stream finishes, the instance deregisters and exits 0."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import httpx
from harness.procs import wait_until
from serve_process import start_serve

from strata.registry import InstanceState, create_registry
from strata.sim.profile import LatencyProfile

# 400 tokens at 20 ms: about 8 s of stream
PROFILE = LatencyProfile(model="m", source="synthetic", prefill_ms_base=2.0,
                         prefill_ms_per_token=0.05, decode_ms_base=20.0, decode_ms_per_seq=0.1)


def record_state(registry_url: str, instance_id: str) -> InstanceState | None:
    async def read() -> InstanceState | None:
        registry = create_registry(registry_url)
        try:
            records = {r.instance_id: r for r in await registry.list_instances()}
        finally:
            await registry.close()
        record = records.get(instance_id)
        return record.state if record is not None else None

    return asyncio.run(read())


def test_sigterm_reports_draining_while_the_stream_in_flight_finishes(tmp_path: Path) -> None:
    PROFILE.save(tmp_path / "profile.json")
    registry = f"sqlite:///{tmp_path / 'registry.db'}"
    server = start_serve(["--simulate", str(tmp_path / "profile.json"), "--served-model-name",
                          "m", "--registry", registry, "--instance-id", "i-0",
                          "--shutdown-timeout-s", "60", "--log-level", "warning"],
                         cache_dir=tmp_path / "cache", timeout_s=120)
    try:
        wait_until(lambda: record_state(registry, "i-0") is InstanceState.READY, 30, "READY")
        body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        is_streaming, is_done = threading.Event(), threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    is_streaming.set()
                    if line:
                        lines.append(line)
            is_done.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert is_streaming.wait(30), "the stream never started"
        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: record_state(registry, "i-0") is InstanceState.DRAINING, 10,
                   "DRAINING in the registry")
        assert not is_done.is_set()  # reported while the stream is still in flight
        reader.join(timeout=60)
        assert lines[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in "".join(lines)
        assert server.proc.wait(timeout=30) == 0
        assert record_state(registry, "i-0") is None  # deregistered
    finally:
        server.stop()
