"""A resumed stream cancelled after its resume, over real sockets: two simulated instances,
each behind a chaos TCP proxy (tests/harness/tcp_proxy.py), a real gateway in front. The first
instance is cut off mid-stream and the gateway resumes the stream on the second; then the
client leaves, or the request's deadline passes. The second instance's request is aborted (its
blocks free, its tokens stop) and counted, as the gateway counts the cancellation."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from harness.tcp_proxy import ChaosProxy
from live_fleet import ServedApp, serve_app
from live_server import metric, wait_until
from sim_instances import SimInstance, start_sim_instance

from strata.engine.engine import Engine
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig, RetryConfig
from strata.gateway.routing.sources import StaticSource
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_engine

# 40 ms a token: 100 tokens last 4 s, the cut comes after a few, the cancellation a second in
PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.5,
                         prefill_ms_per_token=0.005, decode_ms_base=40.0, decode_ms_per_seq=0.1)
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "tell me about the sea"}],
        "max_tokens": 100, "ignore_eos": True, "stream": True, "temperature": 0}
MAX_TOKENS_AFTER_CANCEL = 3  # a step running, one begun before the abort, one of propagation

pytestmark = pytest.mark.timeout(120)


@dataclass
class Member:
    instance: SimInstance
    engine: Engine
    proxy: ChaosProxy

    def cancelled(self) -> float:
        return sum(metric(self.instance.url, "requests_cancelled_total", reason=reason)
                   for reason in ("client_disconnect", "deadline"))


@dataclass
class Fleet:
    members: list[Member]
    gateway: ServedApp

    def member(self, instance_id: str) -> Member:
        return next(m for m in self.members if instance_id.endswith(f":{m.proxy.port}"))

    def counter(self, name: str, **labels: str) -> float:
        return metric(self.gateway.url, name, **labels)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    members = []
    for _ in range(2):
        parts = build_simulated_engine(PROFILE, max_num_seqs=16, kv_blocks=512,
                                       max_model_len=1024)
        instance = start_sim_instance(parts=parts)
        proxy = ChaosProxy(int(instance.url.rsplit(":", 1)[1])).start()
        members.append(Member(instance, parts.engine, proxy))
    config = GatewayConfig(instance_urls=tuple(m.proxy.url for m in members),
                           policy="round_robin", retry=RetryConfig(backoff_base_s=0.0),
                           read_timeout_s=60.0)
    control = httpx.AsyncClient(timeout=1.0)
    app = create_gateway_app(config, StaticSource(config.instance_urls, control),
                             control_client=control)
    running = Fleet(members, serve_app(app))
    yield running
    running.gateway.stop()
    for member in members:
        member.proxy.stop()
        member.instance.stop()


@pytest.mark.parametrize("cancel", ["client_disconnect", "deadline"])
def test_a_resumed_stream_cancelled_after_its_resume_is_aborted_where_it_resumed(
        fleet: Fleet, cancel: str) -> None:
    headers = {"X-Strata-Timeout-S": "1.5"} if cancel == "deadline" else {}
    resumed_before = fleet.counter("gateway_stream_resumes_total", outcome="resumed")
    cancelled_before = fleet.counter("gateway_requests_cancelled_total", reason=cancel)
    raw = b""
    with httpx.stream("POST", f"{fleet.gateway.url}/v1/chat/completions", json=CHAT,
                      headers=headers, timeout=30) as response:
        first = fleet.member(response.headers["x-strata-instance"])
        second = next(m for m in fleet.members if m is not first)
        before = second.cancelled()
        resumed_at: int | None = None
        for i, chunk in enumerate(response.iter_raw()):
            raw += chunk
            if i == 2:
                first.proxy.stop()  # resets its connections: the gateway resumes on `second`
            if i > 2 and resumed_at is None and fleet.counter(
                    "gateway_stream_resumes_total", outcome="resumed") > resumed_before:
                resumed_at = i
            if cancel == "client_disconnect" and resumed_at is not None and i >= resumed_at + 3:
                break  # a few chunks from `second`, then the client leaves
    assert fleet.counter("gateway_stream_resumes_total", outcome="resumed") == resumed_before + 1
    if cancel == "deadline":
        assert b'"deadline_exceeded"' in raw and raw.endswith(b"data: [DONE]\n\n")
    assert wait_until(lambda: second.cancelled() == before + 1)
    tokens_then = second.engine.stats().num_generated_tokens  # its count marks its noticing
    assert wait_until(lambda: fleet.counter("gateway_requests_cancelled_total", reason=cancel)
                      == cancelled_before + 1)
    engine = second.engine
    assert wait_until(lambda: engine.stats().num_free_blocks == engine.stats().num_total_blocks)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_generated_tokens - tokens_then <= MAX_TOKENS_AFTER_CANCEL
    assert stats.num_generated_tokens < 100
    engine.check_integrity()
