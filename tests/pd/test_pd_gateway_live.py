"""Through a real gateway: 1 prefill + 1 decode and 2 + 2 instances of the tiny model answer
exactly as one mixed instance does (float32; greedy and seeded; streamed and not), the decider
keeps short prompts local (the backlog rule: test_pd_decider.py), and a prefill instance that cannot
answer costs the client nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live_fleet import ServedApp
from live_server import wait_until
from pd_fleet import Instance, comparable, mixed, start_gateway, start_instance, stream_mixed
from test_pd_live import LONG, SAMPLING, body_of

from strata.gateway.routing.pd import prompt_bytes_estimate
from strata.model.loader import LoadedModel

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def fleet(tiny_model: LoadedModel) -> Iterator[dict[str, Instance]]:
    instances = {name: start_instance(tiny_model) for name in ("p1", "p2", "d1", "d2", "m")}
    yield instances
    for instance in instances.values():
        instance.stop()


def roles(fleet: dict[str, Instance], *names: str) -> dict[str, tuple[str, str]]:
    return {n: (fleet[n].url, "prefill" if n.startswith("p") else "decode") for n in names}


@pytest.fixture(scope="module", params=["1p1d", "2p2d"])
def gateway(request: pytest.FixtureRequest, fleet: dict[str, Instance]) -> Iterator[ServedApp]:
    names = ("p1", "d1") if request.param == "1p1d" else ("p1", "p2", "d1", "d2")
    served = start_gateway(roles(fleet, *names))
    yield served
    served.stop()


def post(gateway: ServedApp, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{gateway.url}{CHAT}", json=body, timeout=60)


def gateway_names(gateway: ServedApp) -> set[str]:
    instances = httpx.get(f"{gateway.url}/admin/instances").json()["instances"]
    return {i["instance_id"] for i in instances}


def gateway_metric(gateway: ServedApp, name: str, labels: str) -> float:
    prefix = f"strata:{name}{{{labels}}} "
    for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return 0.0


def events(response: httpx.Response) -> list[dict[str, Any]]:
    import json

    assert response.status_code == 200, response.text
    return [json.loads(f.removeprefix("data: ")) for f in response.text.split("\n\n")
            if f.startswith("data: ") and f != "data: [DONE]"]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_a_disaggregated_answer_is_the_mixed_answer(fleet: dict[str, Instance],
                                                    gateway: ServedApp,
                                                    sampling: dict[str, Any]) -> None:
    remote_before = gateway_metric(gateway, "gateway_pd_prefills_total", 'outcome="ok"')
    served_by = set()
    base = 10_000 * len(gateway_names(gateway)) + 100 * len(sampling)  # prompts never seen
    for n in range(3):  # 2 + 2: each prefill and decode instance takes a turn
        body = body_of(LONG, n=base + n, **sampling)
        answer = post(gateway, body)
        assert answer.status_code == 200, answer.text
        assert comparable(answer.json()) == comparable(mixed(fleet["m"], body).json())
        stream_body = {**body_of(LONG, n=base + 50 + n, **sampling),
                       "stream": True, "stream_options": {"include_usage": True}}  # cold too
        expected = [comparable(e) for e in stream_mixed(fleet["m"], stream_body)]
        streamed = post(gateway, stream_body)
        assert [comparable(e) for e in events(streamed)] == expected
        served_by |= {answer.headers["x-strata-instance"], streamed.headers["x-strata-instance"]}
    assert len(served_by) == (2 if "p2" in gateway_names(gateway) else 1)  # every decode one
    assert gateway_metric(gateway, "gateway_pd_prefills_total",
                          'outcome="ok"') == remote_before + 6
    assert wait_until(lambda: all(fleet[p].num_held_blocks == 0 for p in ("p1", "p2")))


def test_short_prompts_prefill_locally(fleet: dict[str, Instance]
                                                            ) -> None:
    served = start_gateway(roles(fleet, "p1", "d1"), min_uncached_tokens=20)
    try:
        short = body_of("hi", n=1, temperature=0)
        assert post(served, short).status_code == 200
        metrics = httpx.get(f"{served.url}/metrics").text
        assert 'strata:gateway_pd_decisions_total{reason="short"} 1.0' in metrics
        assert 'strata:gateway_pd_prefills_total{outcome="ok"} 0.0' in metrics
    finally:
        served.stop()


def test_a_conversation_whose_history_the_decode_instance_holds_is_prefilled_there(
        fleet: dict[str, Instance]) -> None:
    """Multi-turn, the client resending its history: turn 1's long prompt is prefilled remotely
    and its blocks enter the decode instance's prefix cache; turn 2 (turn 1, its answer and a
    short new message) leaves few tokens uncached on that decode instance, as the gateway's
    prefix index (fed by the instances' KV events) says: the decider keeps it there."""
    served = start_gateway(roles(fleet, "p1", "d1"), min_uncached_tokens=40,
                           run_background=True)
    try:
        gateway = served.gateway  # type: ignore[attr-defined]
        turn1 = {**body_of(LONG, n=4242, temperature=0), "max_tokens": 4}
        first = post(served, turn1)
        assert first.status_code == 200, first.text
        assert gateway_metric(served, "gateway_pd_decisions_total", 'reason="remote"') == 1.0
        prefix = gateway.prefix
        # turn 1's KV events all in the index: d1's count of blocks (earlier tests' too) has
        # stopped moving. The events come in batches: the first alone left turn 2 too many
        # uncached tokens, once, when turn 2 came quickly after it
        seen: list[int] = []

        def settled() -> bool:
            seen.append(prefix.index.num_blocks("d1") if prefix.hashers else 0)
            return len(seen) > 4 and seen[-1] > 0 and len(set(seen[-4:])) == 1

        assert wait_until(settled, 30)
        answer = first.json()["choices"][0]["message"]["content"]
        turn2 = {**turn1, "messages": [*turn1["messages"],
                                       {"role": "assistant", "content": answer},
                                       {"role": "user", "content": "and then?"}]}
        assert prompt_bytes_estimate(turn2, []) > 40  # bytes / 4 alone would hand it off
        second = post(served, turn2)
        assert second.status_code == 200, second.text
        assert gateway_metric(served, "gateway_pd_decisions_total", 'reason="short"') == 1.0
        assert gateway_metric(served, "gateway_pd_decisions_total", 'reason="remote"') == 1.0
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 120
    finally:
        served.stop()


def test_a_prefill_instance_that_cannot_answer_costs_nothing(fleet: dict[str, Instance]
                                                            ) -> None:
    dead = {"p0": ("http://127.0.0.1:9", "prefill"), **roles(fleet, "d1")}
    served = start_gateway(dead)
    try:
        body = body_of(LONG, n=77, temperature=0)
        answer = post(served, body)
        assert answer.status_code == 200, answer.text
        assert comparable(answer.json()) == comparable(mixed(fleet["m"], body).json())
        metrics = httpx.get(f"{served.url}/metrics").text
        assert 'strata:gateway_pd_prefills_total{outcome="failed"} 1.0' in metrics
    finally:
        served.stop()


def test_a_client_cannot_send_a_handle_of_its_own(fleet: dict[str, Instance]) -> None:
    served = start_gateway(roles(fleet, "d1"), mode="off")
    try:
        body = body_of(LONG, n=78, temperature=0)
        forged = httpx.post(f"{served.url}{CHAT}", json=body, timeout=60,
                            headers={"X-Strata-Handoff": '{"url": "http://169.254.169.254"}'})
        assert forged.status_code == 200  # the normal route: the header means nothing there
        assert comparable(forged.json()) == comparable(mixed(fleet["m"], body).json())
    finally:
        served.stop()
