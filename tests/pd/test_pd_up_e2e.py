"""`strata up --prefill 1 --decode 1` end to end: real processes (the tiny model, float32), the
real gateway disaggregating, the official `openai` client; the answers are a mixed
instance's; `strata status` shows the roles."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.procs import start_up
from openai import OpenAI
from pd_fleet import Instance, start_instance

from strata.model.loader import LoadedModel

PROMPT = "the weather in the north was cold and wet all week, so the school closed early"


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, dict[str, str]]]:
    root = tmp_path_factory.mktemp("pd-up")
    env = {**os.environ, "STRATA_RUN_DIR": str(root / "run")}
    up = start_up([str(tiny_dir), "--prefill", "1", "--decode", "1", "--dtype", "float32",
                   "--block-size", "8", "--max-model-len", "256", "--threads-per-instance", "1",
                   "--log-level", "warning", "--gateway-arg=--pd-min-uncached-tokens=8"],
                  root / "run", env=env)
    assert "(1 prefill, 1 decode) behind" in up.output()
    yield up.url, env
    assert up.stop(timeout_s=60, sig=signal.SIGINT) == 0
    status = subprocess.run([sys.executable, "-m", "strata.cli", "status"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert "no instances registered" in status.stdout


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> Iterator[Instance]:
    instance = start_instance(tiny_model)
    yield instance
    instance.stop()


def test_the_openai_client_through_a_prefill_decode_cluster(
        cluster: tuple[str, dict[str, str]], reference: Instance) -> None:
    url, _ = cluster
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    mixed = OpenAI(base_url=f"{reference.url}/v1", api_key="unused", max_retries=0)
    ask = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
           "temperature": 0, "logprobs": True, "top_logprobs": 2}
    answer = client.chat.completions.create(model="tiny", **ask)  # type: ignore[call-overload]
    expected = mixed.chat.completions.create(model="tiny-llama", **ask)  # type: ignore[call-overload]
    assert answer.choices == expected.choices and answer.usage == expected.usage
    chunks = client.chat.completions.create(model="tiny", stream=True, seed=5, temperature=0.8,
                                            messages=ask["messages"], max_tokens=8)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected_seeded = mixed.chat.completions.create(model="tiny-llama", seed=5, temperature=0.8,
                                                    messages=ask["messages"], max_tokens=8)
    assert streamed == expected_seeded.choices[0].message.content
    metrics = httpx.get(f"{url}/metrics").text
    # the first is prefilled remotely; the second repeats the prompt, whose blocks the decode
    # instance now holds (imported by the first), so its few uncached tokens stay there
    assert 'strata:gateway_pd_prefills_total{outcome="ok"} 1.0' in metrics
    assert 'strata:gateway_pd_decisions_total{reason="remote"} 1.0' in metrics
    assert 'strata:gateway_pd_decisions_total{reason="short"} 1.0' in metrics


def test_status_shows_the_roles(cluster: tuple[str, dict[str, str]]) -> None:
    url, env = cluster
    instances = httpx.get(f"{url}/admin/instances").json()["instances"]
    assert sorted(i["role"] for i in instances) == ["decode", "prefill"]
    status = subprocess.run([sys.executable, "-m", "strata.cli", "status"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "pool default: 1 decode (1 ready), 1 prefill (1 ready)" in status.stdout
    assert re.search(r"tiny-default-0 .* prefill +default +ready", status.stdout)
