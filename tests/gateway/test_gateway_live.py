"""End to end over real sockets: real instance servers (tiny model), each behind a cuttable TCP
relay, and the gateway in front, driven with the official `openai` client and httpx."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_fleet import Fleet, Relay, serve_app
from live_server import MODEL_NAME, GatedExecutor, load_tiny, start_server, wait_until
from tiny_models import make_tiny_model_dir

from strata.commands import gateway as gateway_command
from strata.commands.env import CliEnv
from strata.gateway.app import create_gateway_app
from strata.gateway.config import EjectionConfig
from strata.gateway.routing.sources import StaticSource
from strata.model.loader import LoadedModel
from strata.protocol.sse import SSEParser

ENV = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_tiny(make_tiny_model_dir(tmp_path_factory.mktemp("gateway") / "tiny"))


def parse_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["gateway", *flags])


def start_fleet(model: LoadedModel, num_instances: int, *, gated: bool = False,
                flags: tuple[str, ...] = ()) -> Fleet:
    fleet = Fleet([], [])
    try:
        for _ in range(num_instances):
            wrap = (lambda inner: _gate(fleet, inner)) if gated else None
            fleet.servers.append(start_server(model, wrap=wrap))
            fleet.relays.append(Relay(int(fleet.servers[-1].base_url.rsplit(":", 1)[1])))
        args = parse_flags("--instances", *[r.url for r in fleet.relays], "--port", "0",
                           "--policy", "round_robin", "--health-check-interval-s", "0.2",
                           *flags)
        config = dataclasses.replace(gateway_command.build_config(args, ENV),
                                     ejection=EjectionConfig(base_ejection_s=1.0),
                                     read_timeout_s=30.0)
        control = httpx.AsyncClient(timeout=1.0)
        app = create_gateway_app(config, StaticSource(config.instance_urls, control),
                                 control_client=control)
        fleet.gateway = serve_app(app)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _gate(fleet: Fleet, inner: object) -> GatedExecutor:
    gate = GatedExecutor(inner)
    fleet.gates.append(gate)
    return gate


def instance_id(relay: Relay) -> str:
    return f"127.0.0.1:{relay.port}"


def openai_client(fleet: Fleet) -> openai.OpenAI:
    assert fleet.gateway is not None
    return openai.OpenAI(base_url=f"{fleet.gateway.url}/v1", api_key="unused", max_retries=0,
                         timeout=30.0)


@pytest.fixture(scope="module")
def fleet(tiny_model: LoadedModel) -> Iterator[Fleet]:
    running = start_fleet(tiny_model, 3)
    yield running
    running.stop()


def test_openai_client_through_the_gateway_spreads_requests(fleet: Fleet) -> None:
    client = openai_client(fleet)
    served = []
    for _ in range(6):
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt="hello there", max_tokens=6, temperature=0)
        served.append(raw.headers["x-strata-instance"])
        text = raw.parse().choices[0].text
    assert Counter(served) == {instance_id(r): 2 for r in fleet.relays}
    stream = client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=6,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text


def test_chat_streaming_and_not_and_models_aggregated(fleet: Fleet) -> None:
    client = openai_client(fleet)
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore
                                           max_tokens=5, temperature=0)
    chunks = client.chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore
                                            max_tokens=5, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_an_answer_through_the_gateway_has_one_date_and_one_server_header(fleet: Fleet) -> None:
    """The instance's `date` and `server` stay behind: the gateway's server sets its own (the
    client once got both twice)."""
    assert fleet.gateway is not None
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    for stream in (False, True):
        answer = httpx.post(f"{fleet.gateway.url}/v1/completions",
                            json={**body, "stream": stream}, timeout=30)
        assert answer.status_code == 200
        assert len(answer.headers.get_list("date")) == 1, answer.headers
        assert len(answer.headers.get_list("server")) <= 1, answer.headers
        assert answer.headers["x-strata-instance"]


def read_events(chunks: Iterator[bytes], parser: SSEParser, until_first: bool) -> list[str]:
    events: list[str] = []
    for chunk in chunks:
        events += parser.feed(chunk)
        if until_first and events:
            break
    return events


def admin_view(fleet: Fleet, relay: Relay) -> dict[str, object]:
    assert fleet.gateway is not None
    listed = httpx.get(f"{fleet.gateway.url}/admin/instances").json()["instances"]
    by_id: dict[str, dict[str, object]] = {i["instance_id"]: i for i in listed}
    return by_id[instance_id(relay)]


def test_an_instance_dies_streams_end_cleanly_others_take_over_it_is_ejected_and_rejoins(
        tiny_model: LoadedModel) -> None:
    # resuming off: the stream that broke ends with an error event (what a stream that cannot
    # be resumed gets; tests/gateway/test_resume_live.py resumes them)
    fleet = start_fleet(tiny_model, 3, gated=True, flags=("--max-resumes", "0"))
    try:
        victim = _break_a_stream(fleet)
        for gate in fleet.gates:
            gate.open()  # type: ignore[attr-defined]
        client = openai_client(fleet)
        served = []
        for i in range(6):  # none had started: all succeed, on the others
            raw = client.completions.with_raw_response.create(
                model=MODEL_NAME, prompt=f"request {i}", max_tokens=4, stream=i % 2 == 1)
            served.append(raw.headers["x-strata-instance"])
            raw.parse()
        assert instance_id(victim) not in served
        assert wait_until(lambda: admin_view(fleet, victim)["ejected"] is True, timeout_s=5.0)
        victim.restart()  # the instance comes back on the same address
        assert wait_until(lambda: admin_view(fleet, victim)["routable"] is True, timeout_s=10.0)
        back = [client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt="again", max_tokens=2).headers["x-strata-instance"]
            for _ in range(3)]
        assert instance_id(victim) in back
    finally:
        fleet.stop()


def _break_a_stream(fleet: Fleet) -> Relay:
    """Starts a stream, kills its instance after the first event; returns the victim's relay."""
    assert fleet.gateway is not None
    for gate in fleet.gates:
        # greedy: the 2 steps each gate allows give this prompt a visible first frame
        gate.hold(allow=2)  # type: ignore[attr-defined]
    body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 60, "stream": True,
            "ignore_eos": True, "temperature": 0}
    parser = SSEParser()
    with httpx.stream("POST", f"{fleet.gateway.url}/v1/completions", json=body,
                      timeout=60.0) as response:
        served_by = response.headers["x-strata-instance"]
        chunks = response.iter_raw()
        first = read_events(chunks, parser, until_first=True)
        victim = next(r for r in fleet.relays if instance_id(r) == served_by)
        victim.kill()
        killed_at = time.monotonic()
        rest = read_events(chunks, parser, until_first=False)
        ended_after_s = time.monotonic() - killed_at
    assert json.loads(first[0])["choices"][0]["index"] == 0
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "upstream_error" and served_by in error["message"]
    assert all("error" not in json.loads(e) for e in first + rest[:-2])
    # the break was detected, not waited out: far below the 30 s read timeout
    assert ended_after_s < 5.0, ended_after_s
    return victim
