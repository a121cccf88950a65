"""A disaggregated request cancelled, over real sockets: a gateway in front of a prefill
instance P and a decode instance D (tests/pd/pd_fleet.py), both paced. A client that leaves
during decode aborts D's request; a deadline that passes during the remote prefill aborts P's,
and the blocks P computed for the hand-off are never leased. Each story ends with every block
free on both instances, nothing held, and the cancellation counted by reason on the /metrics of
the instance and of the gateway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from live_fleet import ServedApp
from live_server import PacedExecutor, metric, wait_until
from pd_fleet import CHAT, MODEL, Instance, start_gateway, start_instance

from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel

STEP_S = 0.05
BODY = {"model": MODEL, "max_tokens": 100, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "a prompt long enough to hand off " * 4}]}
MAX_STEPS_AFTER_CANCEL = 3  # the step running, one begun before the abort, one of propagation


@dataclass
class Paced:
    instance: Instance
    executor: PacedExecutor

    def cancelled(self, reason: str) -> float:
        return self.instance.metric("requests_cancelled_total", reason=reason)

    def assert_all_free(self, steps_then: int) -> None:
        engine = self.instance.engine
        assert wait_until(lambda: engine.stats().num_free_blocks
                          == engine.stats().num_total_blocks)
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_held_blocks) == (0, 0, 0)
        assert self.executor.num_steps - steps_then <= MAX_STEPS_AFTER_CANCEL
        engine.check_integrity()


@dataclass
class Fleet:
    p: Paced
    d: Paced
    gateway: ServedApp

    def cancelled(self, reason: str) -> float:
        return metric(self.gateway.url, "gateway_requests_cancelled_total", reason=reason)


def paced(model: LoadedModel) -> Paced:
    executor = PacedExecutor(TorchExecutor(model.config, model.weights, dtype="float32",
                                           model_name=MODEL, model_version="v1"), STEP_S)
    return Paced(start_instance(model, executor=executor), executor)


@pytest.fixture(scope="module")
def fleet(tiny_model: LoadedModel) -> Iterator[Fleet]:
    p, d = paced(tiny_model), paced(tiny_model)
    gateway = start_gateway({"p": (p.instance.url, "prefill"), "d": (d.instance.url, "decode")})
    yield Fleet(p, d, gateway)
    gateway.stop()
    for side in (p, d):
        side.instance.stop()


def test_a_client_that_leaves_during_decode_frees_both_instances(fleet: Fleet) -> None:
    p, d = fleet.p, fleet.d
    answered = p.instance.metric("pd_handoffs_total", side="prefill", outcome="answered")
    before = (d.cancelled("client_disconnect"), fleet.cancelled("client_disconnect"))
    with httpx.stream("POST", f"{fleet.gateway.url}{CHAT}", json=BODY | {"stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    assert p.instance.metric("pd_handoffs_total", side="prefill",
                             outcome="answered") == answered + 1  # it was a hand-off
    assert wait_until(lambda: (d.cancelled("client_disconnect"),
                               fleet.cancelled("client_disconnect"))
                      == (before[0] + 1, before[1] + 1))
    d.assert_all_free(d.executor.num_steps)  # within a step of D's noticing, its count marks
    p.assert_all_free(p.executor.num_steps)
    assert d.instance.engine.stats().num_generated_tokens < 100


def test_a_client_that_leaves_a_json_answer_during_decode_frees_both_instances(
        fleet: Fleet) -> None:
    p, d = fleet.p, fleet.d
    before = (d.cancelled("client_disconnect"), fleet.cancelled("client_disconnect"))
    generated = d.instance.engine.stats().num_generated_tokens
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{fleet.gateway.url}{CHAT}", json=BODY, timeout=1.0)
    # a JSON answer's waits poll for their client (every 0.25 s, on the gateway, then on D):
    # the blocks are free within a step of D's noticing, which its count marks
    assert wait_until(lambda: (d.cancelled("client_disconnect"),
                               fleet.cancelled("client_disconnect"))
                      == (before[0] + 1, before[1] + 1))
    d.assert_all_free(d.executor.num_steps)
    p.assert_all_free(p.executor.num_steps)
    assert d.instance.engine.stats().num_generated_tokens - generated < 100


def test_a_deadline_that_passes_during_the_remote_prefill_frees_both_instances(
        fleet: Fleet) -> None:
    p, d = fleet.p, fleet.d
    p.executor.step_s = 1.5  # the prefill's one step outlasts the deadline
    before_p = p.cancelled("deadline") + p.cancelled("client_disconnect")
    before_gw, before_d = fleet.cancelled("deadline"), d.executor.num_steps
    try:
        r = httpx.post(f"{fleet.gateway.url}{CHAT}", json=BODY,
                       headers={"X-Strata-Timeout-S": "0.5"}, timeout=30)
        steps_then = p.executor.num_steps
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "deadline_exceeded"
        assert r.headers["x-should-retry"] == "false"
        # P's own deadline and the gateway hanging up come together: one of them counts
        assert wait_until(lambda: p.cancelled("deadline") + p.cancelled("client_disconnect")
                          == before_p + 1)
        p.assert_all_free(steps_then)
    finally:
        p.executor.step_s = STEP_S
    assert fleet.cancelled("deadline") == before_gw + 1
    assert p.instance.num_held_blocks == 0 and p.instance.metric("pd_blocks_held") == 0
    assert d.executor.num_steps == before_d  # D never saw it
    d.assert_all_free(before_d)
