"""deploy/docker/drain.py (the Helm chart's preStop hook) and probe.py (the containers' health
check) against a real `strata serve --simulate` instance with an API key.

The story: the instance is ready; a long stream starts; a drain without the key is refused
(exit 1) and changes nothing; a drain with the key makes the instance refuse new work, reports
the one request in flight, waits until that stream has finished whole, and exits 0; the
instance is then no longer ready.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_files import DEPLOY
from serve_process import ServeProcess, start_serve

DRAIN = DEPLOY / "docker" / "drain.py"
PROBE = DEPLOY / "docker" / "probe.py"
KEY = "drain-test-key"  # a client's
INTERNAL_KEY = "drain-test-internal-key"  # the fleet's: what drains an instance


@pytest.fixture()
def instance(tmp_path: Path) -> Iterator[ServeProcess]:
    key_file, internal_file = tmp_path / "keys", tmp_path / "internal-key"
    key_file.write_text(f"{KEY}\n")
    internal_file.write_text(f"{INTERNAL_KEY}\n")
    served = start_serve(["--simulate", "smollm2-cpu", "--api-key-file", str(key_file),
                          "--internal-key-file", str(internal_file),
                          "--log-level", "warning"], cache_dir=tmp_path / "cache",
                         timeout_s=120)
    yield served
    served.stop()


def run_script(script: Path, *args: str, key: str | None = None,
               key_env: str = "STRATA_INTERNAL_KEYS",
               timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    if key is not None:
        env[key_env] = key
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, check=False)


class Stream:
    """A long streamed completion on its own thread; `started` is set at its first event."""

    def __init__(self, url: str, model: str) -> None:
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.started.set()
        except BaseException as exc:  # surfaced by join()
            self.error = exc
            self.started.set()

    def join(self) -> list[str]:
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the stream did not finish"
        if self.error is not None:
            raise self.error
        return self.events


def test_drain_waits_for_the_request_in_flight_then_the_instance_is_not_ready(
        instance: ServeProcess) -> None:
    assert run_script(PROBE, f"{instance.url}/ready").returncode == 0
    stream = Stream(instance.url, instance.served_name)
    assert stream.started.wait(timeout=30) and stream.error is None

    refused = run_script(DRAIN, f"--url={instance.url}", "--timeout-s=30")
    assert refused.returncode == 1 and "401" in refused.stderr
    by_a_client = run_script(DRAIN, f"--url={instance.url}", "--timeout-s=30", key=KEY,
                             key_env="STRATA_ADMIN_KEYS")
    assert by_a_client.returncode == 1 and "403" in by_a_client.stderr
    assert httpx.get(f"{instance.url}/ready", timeout=5).status_code == 200

    drained = run_script(DRAIN, f"--url={instance.url}", "--timeout-s=30", "--poll-s=0.05",
                         key=INTERNAL_KEY)
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.splitlines() == ["drain: draining, 1 request(s) in flight",
                                           "drain: idle"]
    events = stream.join()  # already whole: the drain returned only once it had finished
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]
                if c.get("finish_reason")]
    assert finishes == ["length"]  # all 400 tokens: the drain cut nothing short
    assert httpx.get(f"{instance.url}/ready", timeout=5).status_code == 503
    assert run_script(PROBE, f"{instance.url}/ready").returncode == 1
    assert run_script(PROBE, f"{instance.url}/health").returncode == 0
    load = httpx.get(f"{instance.url}/load", timeout=5).json()
    assert load["draining"] is True and load["num_in_flight"] == 0


def test_drain_of_an_unreachable_instance_fails_fast() -> None:
    done = run_script(DRAIN, "--url=http://127.0.0.1:9", "--timeout-s=5", timeout_s=30)
    assert done.returncode == 1 and "failed" in done.stderr
