"""A disaggregated request whose decode instance fails mid-stream, traced: a prefill instance
computes the prompt, a decode instance pulls its blocks and streams, its connections are cut
after the first frames, and the gateway resumes the stream on the other decode instance. All of
it, on simulated instances over real sockets (each decode instance behind a chaos TCP proxy),
is one trace under the client's span, the hand-off's parts included."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from harness.tcp_proxy import ChaosProxy
from live_fleet import ServedApp
from live_server import serve_in_thread, wait_until
from pd_fleet import INTERNAL_KEY, MODEL, start_gateway
from span_tree import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT, Spans, ancestors, orphans
from span_tree import trace_ids as trace_ids_of

from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.sim.profile import LatencyProfile
from strata.sim.server import build_simulated_async_engine, build_simulated_engine

pytestmark = pytest.mark.timeout(120)
# 40 ms a token: the stream is still going when its instance is cut off after two chunks
PROFILE = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.2,
                         prefill_ms_per_token=0.01, decode_ms_base=40.0, decode_ms_per_seq=0.1,
                         kv_bytes_per_token=2_000)
PROMPT = " ".join(f"word{i}" for i in range(120))
BODY = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
        "temperature": 0, "stream": True}
DECODE = "strata.instance /internal/decode/v1/chat/completions"
PREFILL = "strata.instance /internal/prefill/v1/chat/completions"
RESUME = "strata.instance /v1/strata/resume"


@dataclass
class Sim:
    url: str
    stop_server: object

    def stop(self) -> None:
        server, thread = self.stop_server  # type: ignore[misc]
        server.should_exit = True
        thread.join(timeout=30)


def start_sim() -> Sim:
    parts = build_simulated_engine(PROFILE, kv_blocks=256, max_model_len=1024,
                                   namespace=f"{MODEL}@v1", kv_bandwidth_gbps=1.0)
    async_engine, tokenizer = build_simulated_async_engine(parts)
    app = create_app(async_engine, tokenizer, ServerConfig(
        served_model_name=MODEL, model_version="v1", simulated=True,
        internal_keys=(INTERNAL_KEY,)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server_thread = serve_in_thread(app, sock)
    return Sim(f"http://127.0.0.1:{sock.getsockname()[1]}", server_thread)


@dataclass
class Fleet:
    proxies: dict[str, ChaosProxy]  # decode instance id -> its proxy
    gateway: ServedApp


@pytest.fixture
def fleet(spans: Spans) -> Iterator[Fleet]:
    sims = {name: start_sim() for name in ("p", "d0", "d1")}
    proxies = {name: ChaosProxy(int(sims[name].url.rsplit(":", 1)[1])).start()
               for name in ("d0", "d1")}
    gateway = start_gateway({"p": (sims["p"].url, "prefill"),
                             "d0": (proxies["d0"].url, "decode"),
                             "d1": (proxies["d1"].url, "decode")})
    yield Fleet(proxies, gateway)
    gateway.stop()
    for proxy in proxies.values():
        proxy.stop()
    for sim in sims.values():
        sim.stop()


def test_a_disaggregated_stream_resumed_after_its_decode_instance_failed_is_one_trace(
        spans: Spans, fleet: Fleet) -> None:
    raw = b""
    with httpx.stream("POST", f"{fleet.gateway.url}/v1/chat/completions", json=BODY,
                      headers={"traceparent": TRACEPARENT}, timeout=60) as response:
        first = response.headers["x-strata-instance"]
        for i, chunk in enumerate(response.iter_raw()):
            raw += chunk
            if i == 2:
                fleet.proxies[first].stop()  # resets its connections mid-stream
    assert raw.endswith(b"data: [DONE]\n\n") and b"error" not in raw
    assert wait_until(lambda: {DECODE, PREFILL, RESUME} <= spans.names()
                      and len(spans.named("strata.engine.request")) == 3)
    got = spans.all()
    assert trace_ids_of(got) == {CLIENT_TRACE_ID}
    assert orphans(got, CLIENT_SPAN_ID) == []
    by_name: dict[str, list] = {}
    for span in got:
        by_name.setdefault(span.name, []).append(span)
    gateway_root = "strata.gateway /v1/chat/completions"
    steps = ["strata.gateway.step.HandOff", "strata.gateway.step.KeyPrefix",
             "strata.gateway.step.Admit",
             "strata.gateway.step.MeterTenants", gateway_root]
    # the gateway's hand-off: its decision, then P's prefill under its own call
    hand_off, = by_name["strata.gateway.step.HandOff"]
    assert hand_off.attributes is not None and hand_off.attributes["strata.pd.decision"] == \
        "remote"
    prefill, = by_name[PREFILL]
    assert ancestors(prefill, got) == ["strata.gateway.pd.prefill", *steps]
    handle, = by_name["strata.pd.handle"]
    assert ancestors(handle, got) == [PREFILL, "strata.gateway.pd.prefill", *steps]
    # D's pull of P's blocks, checked, then their import by D's engine
    pull, = by_name["strata.pd.pull"]
    decode, = by_name[DECODE]
    assert ancestors(pull, got)[:2] == [DECODE, "strata.gateway.attempt"]
    assert pull.attributes is not None and pull.attributes["strata.pd.checks"] == "complete"
    assert pull.attributes["strata.pd.bytes"] > 0
    assert pull.attributes["strata.pd.num_blocks_pulled"] == \
        pull.attributes["strata.pd.num_blocks_wanted"] > 0
    assert pull.attributes["strata.pd.peer"] == "p"
    # P served the pull (GET) under it, and D's acknowledgement (DELETE) under D's request
    served = {s.attributes["http.request.method"]: ancestors(s, got)[0] for s in
              by_name["strata.instance /internal/kv/{handle}"] if s.attributes is not None
              and s.attributes["url.path"] == f"/internal/kv/{pull.attributes['strata.pd.handle']}"}
    assert served == {"GET": "strata.pd.pull", "DELETE": DECODE}
    layout, = by_name["strata.instance /internal/kv/layout"]  # the handshake, before the pull
    assert ancestors(layout, got)[0] == DECODE
    kv_import, = by_name["strata.engine.kv_import"]
    assert ancestors(kv_import, got)[:2] == ["strata.engine.request", DECODE]
    assert kv_import.attributes is not None and kv_import.attributes["strata.kv.num_imported"] \
        == pull.attributes["strata.pd.num_blocks_pulled"]
    # the first decode attempt, then the resume on the other decode instance
    attempts = {s.attributes["strata.attempt.kind"]: s for s in by_name["strata.gateway.attempt"]
                if s.attributes is not None}
    assert attempts["request"].attributes["strata.instance.id"] == first  # type: ignore[index]
    other = "d1" if first == "d0" else "d0"
    assert attempts["resume"].attributes["strata.instance.id"] == other  # type: ignore[index]
    resume, = by_name["strata.gateway.resume"]
    assert resume.attributes is not None and resume.attributes["strata.resume.outcome"] == \
        "resumed"
    assert list(resume.attributes["strata.resume.tried"]) == [first]
    resumed, = by_name[RESUME]
    assert ancestors(resumed, got) == ["strata.gateway.attempt", "strata.gateway.resume",
                                       gateway_root]
    # three engine requests, one on each instance, each under its instance's span
    parents = sorted(ancestors(s, got)[0] for s in by_name["strata.engine.request"])
    assert parents == sorted([DECODE, PREFILL, RESUME])
