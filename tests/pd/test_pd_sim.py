"""The simulated hand-off: simulated instances export stand-ins of their blocks after the time
the profiled model's bytes would take, a simulated decode instance imports them and computes
none of the prompt, and the answer is a simulated mixed instance's."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from live_server import serve_in_thread, wait_until
from pd_fleet import INTERNAL_KEY, comparable, decode, mixed, prefill

from strata.engine.engine import Engine
from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.sim.executor import SimulatedExecutor
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine
from strata.sim.transfer import fit_min_uncached_tokens, modeled_bytes, stand_in, transfer_s

PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.2,
                         prefill_ms_per_token=0.01, decode_ms_base=0.5, decode_ms_per_seq=0.05,
                         kv_bytes_per_token=20_000)
BANDWIDTH_GBPS = 0.05  # slow, so the modeled transfer (about 6 ms a block) shows


@dataclass
class Sim:
    url: str
    engine: Engine
    stop: Any


def start_sim(bandwidth_gbps: float = BANDWIDTH_GBPS) -> Sim:
    parts = build_simulated_engine(PROFILE, kv_blocks=256, max_model_len=1024,
                                   namespace="sim-model@v1", kv_bandwidth_gbps=bandwidth_gbps)
    async_engine, tokenizer = build_simulated_async_engine(parts)
    app = create_app(async_engine, tokenizer, ServerConfig(
        served_model_name="sim-model", model_version="v1", simulated=True,
        internal_keys=(INTERNAL_KEY,)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, thread = serve_in_thread(app, sock)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=30)

    return Sim(f"http://127.0.0.1:{sock.getsockname()[1]}", parts.engine, stop)


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, Sim]]:
    fleet = {"p": start_sim(), "d": start_sim(), "m": start_sim()}
    yield fleet
    for sim in fleet.values():
        sim.stop()


PROMPT = " ".join(f"word{i}" for i in range(150))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}],
                         ids=["greedy", "seeded"])
def test_a_simulated_hand_off_answers_as_a_simulated_mixed_instance(
        sims: dict[str, Sim], sampling: dict[str, Any]) -> None:
    p, d, m = sims["p"], sims["d"], sims["m"]
    body = {"model": "sim-model", "prompt": f"{sampling} {PROMPT}", "max_tokens": 12,
            "logprobs": 1, **sampling}
    path = "/v1/completions"
    prompt_tokens_before = d.engine.stats().num_prompt_tokens
    handle = prefill(p, body, path)
    began = time.perf_counter()
    answer = decode(d, body, handle, path)
    elapsed_s = time.perf_counter() - began
    assert comparable(answer.json()) == comparable(mixed(m, body, path).json())
    assert d.engine.stats().num_prompt_tokens == prompt_tokens_before  # nothing recomputed
    blocks = -(-answer.json()["usage"]["prompt_tokens"] // 16)
    assert elapsed_s >= transfer_s(blocks * 16 * 20_000, BANDWIDTH_GBPS)  # the modeled pull
    assert wait_until(lambda: p.engine.stats().num_held_blocks == 0)


def test_stand_ins_carry_their_modeled_size_and_a_checksum() -> None:
    payload = stand_in(320_000)
    assert modeled_bytes(payload) == 320_000
    damaged = bytearray(payload)
    damaged[6] ^= 1
    assert modeled_bytes(bytes(damaged)) is None and modeled_bytes(b"STKV" * 5) is None
    slept: list[float] = []
    executor = SimulatedExecutor(PROFILE, 100, sleep=slept.append, kv_bandwidth_gbps=2.0)
    executor.allocate_kv_cache(8, 16)
    exported = executor.export_blocks([0, 1, 2])
    assert slept == []  # the engine thread exports: the modeled link is the stream's wait
    assert executor.link_s(3) == pytest.approx(3 * 16 * 20_000 / 2e9)
    assert executor.import_blocks([3, 4, 5], exported) == 3
    other = SimulatedExecutor(PROFILE, 100)
    other.allocate_kv_cache(8, 32)  # other block size: other block bytes
    assert other.import_blocks([0, 1], exported[:2]) == 0


def test_a_simulated_peer_is_refused_by_a_real_one() -> None:
    from strata.server.pd.layout import differences, local_layout

    executor = SimulatedExecutor(PROFILE, 100)
    simulated = local_layout("m", "v1", "m@v1", 16, executor)
    real = {**simulated, "dtype": "bfloat16", "num_layers": 30}
    assert differences(real, simulated)[0] == "dtype"


def test_the_decider_default_is_fitted_from_the_profile() -> None:
    from strata.gateway.config import PDRoutingConfig
    from strata.sim import load_profile

    smollm2 = load_profile("smollm2-cpu")
    # the measured fixed cost of a hand-off (docs/benchmarks.md): 15 ms
    assert fit_min_uncached_tokens(smollm2, handoff_overhead_ms=15) == 368 == \
        PDRoutingConfig().min_uncached_tokens
    # a free hop: the stall bound alone (4 decode steps of a batch of 8 is 112 tokens' prefill)
    assert fit_min_uncached_tokens(smollm2, handoff_overhead_ms=0) == 112
    assert fit_min_uncached_tokens(smollm2, handoff_overhead_ms=20) == 496
