"""`strata serve --lora-modules` with four adapters and `--max-cpu-loras 2`, a real process.

An adapter loaded on demand gives the tokens of an always-resident one (HF+PEFT's, which
tests/lora/test_lora_serve.py pins for resident adapters); 48 requests round-robin over the four
adapters, 8 at a time, all succeed with their adapter's tokens while adapters are evicted and
loaded back; /metrics shows at most two resident, the loads, evictions and load seconds, and
GET /load each adapter's residency, which a gateway with `--policy adapter_aware` reads to
route adapter names (in process, over real sockets).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from live_fleet import serve_gateway
from live_server import wait_until
from lora_fixtures import hf_greedy, make_adapter, make_models
from resume_streams import frames_of
from serve_process import ServeProcess, start_serve

from strata.protocol.resume import RESUMABLE_HEADER

N = 6
PROMPT = [(7 * i + 3) % 250 for i in range(13)]
NAMES = ("lora-a", "lora-b", "lora-c", "lora-d")


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-on-demand")
    found = make_models(root)
    found["c"] = make_adapter(found["base"], root / "lora-c", seed=3, r=4, alpha=8,
                              targets=["q_proj", "v_proj"])
    found["d"] = make_adapter(found["base"], root / "lora-d", seed=4, r=2, alpha=4,
                              targets=["o_proj", "gate_proj", "up_proj"])
    return found


@pytest.fixture(scope="module")
def server(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServeProcess]:
    modules = [f"{name}={paths[name[-1]]}" for name in NAMES]
    proc = start_serve([str(paths["base"]), "--served-model-name", "tiny", "--dtype", "float32",
                        "--block-size", "4", "--kv-cache-gb", "0.01", "--max-cpu-loras", "2",
                        "--lora-modules", *modules],
                       cache_dir=tmp_path_factory.mktemp("cache"), timeout_s=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def want(server: ServeProcess, paths: dict[str, Path]) -> dict[str, list[int]]:
    tokens = {name: hf_greedy(paths["base"], paths[name[-1]], PROMPT, N) for name in NAMES}
    assert len({tuple(t) for t in tokens.values()}) == 4  # four different answers
    return tokens


def tokens(server: ServeProcess, model: str) -> list[int]:
    """The answer's token ids (a resumable stream's marks carry them)."""
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, headers={RESUMABLE_HEADER: "1"},
                   json={"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
                         "ignore_eos": True, "stream": True})
    assert r.status_code == 200, r.text
    assert b'"error"' not in r.content, r.text
    return [t for frame in frames_of(r.content) for t in frame.token_ids]


def metric(server: ServeProcess, name: str) -> float:
    body = httpx.get(f"{server.url}/metrics", timeout=30).text
    for line in body.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_an_adapter_loaded_on_demand_gives_the_resident_tokens(
        server: ServeProcess, want: dict[str, list[int]]) -> None:
    assert metric(server, "strata:lora_resident_adapters") == 2  # a and b, at start
    models = {m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}
    assert models == {"tiny", *NAMES}  # known, resident or not
    for name in ("lora-c", "lora-d", "lora-a"):  # c and d on demand; a evicted then back
        assert tokens(server, name) == want[name], name
    assert metric(server, "strata:lora_loads_total") == 3
    assert metric(server, "strata:lora_evictions_total") == 3
    assert metric(server, "strata:lora_resident_adapters") == 2
    # the load report the gateway places adapters by: every adapter known, resident or not
    report = httpx.get(f"{server.url}/load", timeout=30).json()["adapters"]
    assert [(a["name"], "digest" in a, a.get("num_loads", 0), a.get("num_evictions", 0))
            for a in report] == [("lora-a", True, 1, 1), ("lora-b", False, 0, 1),
                                 ("lora-c", False, 1, 1), ("lora-d", True, 1, 0)]
    assert all(a["load_s"] > 0 for a in report if "num_loads" in a)


def test_round_robin_over_four_adapters_under_load_fails_nothing(
        server: ServeProcess, want: dict[str, list[int]]) -> None:
    loads = metric(server, "strata:lora_loads_total")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: (NAMES[i % 4], tokens(server, NAMES[i % 4])),
                                range(48)))
    for name, answer in answers:
        assert answer == want[name], name
    assert metric(server, "strata:lora_loads_total") > loads  # adapters went and came back
    assert metric(server, "strata:lora_resident_adapters") <= 2
    assert metric(server, "strata:lora_resident_bytes") > 0
    assert metric(server, "strata:lora_load_seconds_count") == metric(
        server, "strata:lora_loads_total")


def test_the_gateway_places_adapters_by_the_residency_the_instance_reports(
        server: ServeProcess, want: dict[str, list[int]]) -> None:
    gateway = serve_gateway(["--instances", server.url, "--policy", "adapter_aware"])
    try:
        def gateway_metric(name: str, adapter: str) -> float | None:
            body = httpx.get(f"{gateway.url}/metrics", timeout=30).text
            prefix = f'{name}{{adapter="{adapter}"}} '
            found = [line for line in body.splitlines() if line.startswith(prefix)]
            return float(found[0].split()[-1]) if found else None

        assert wait_until(lambda: gateway_metric(
            "strata:gateway_adapter_resident_instances", "lora-b") is not None)
        body = {"model": "lora-b", "prompt": PROMPT, "max_tokens": N, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(f"{gateway.url}/v1/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text  # an adapter name routes (it was a 404 before)
        direct = httpx.post(f"{server.url}/v1/completions", timeout=120, json=body).json()
        assert r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        assert gateway_metric("strata:gateway_adapter_replicas", "lora-b") == 1
        assert gateway_metric("strata:gateway_adapter_loads_total", "lora-b") is not None
        missing = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                             json={"model": "lora-z", "prompt": "x", "max_tokens": 1})
        assert missing.status_code == 404 and "lora-b" in missing.text
    finally:
        gateway.stop()
