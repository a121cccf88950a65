"""A plain request cancelled on its instance, over real sockets: by its deadline (a header for
the openai client, the body's `timeout` for a stream) and by its client leaving (a JSON answer
and a stream). Each story ends with every KV block back in the free pool within one engine step
of the cancellation, the request far from its 100 tokens, and one count on /metrics by reason.

The engine is paced (each step at least STEP_S) so that a request of 100 tokens lasts seconds:
a request that was not aborted runs on, and the step count after the cancellation tells it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from live_server import MODEL_NAME, LiveServer, PacedExecutor, metric, start_server, wait_until

from strata.model.loader import LoadedModel

STEP_S = 0.05
LONG = {"model": MODEL_NAME, "prompt": "a request that will not finish", "max_tokens": 100,
        "ignore_eos": True, "temperature": 0}
# the step running when the abort is posted, and one that may have begun before it was read
MAX_STEPS_AFTER_CANCEL = 2


@pytest.fixture(scope="module")
def paced(tiny_model: LoadedModel) -> Iterator[tuple[LiveServer, PacedExecutor]]:
    executors: list[PacedExecutor] = []

    def wrap(inner: object) -> PacedExecutor:
        executors.append(PacedExecutor(inner, STEP_S))
        return executors[0]

    live = start_server(tiny_model, wrap=wrap)
    yield live, executors[0]
    live.stop()


def cancelled(live: LiveServer, reason: str) -> float:
    return metric(live.base_url, "requests_cancelled_total", reason=reason)


def assert_freed_within_a_step(live: LiveServer, executor: PacedExecutor, steps_then: int,
                               generated_before: int) -> None:
    stats = live.engine.stats()
    assert wait_until(lambda: live.async_engine.num_in_flight == 0
                      and live.engine.stats().num_free_blocks == stats.num_total_blocks)
    assert executor.num_steps - steps_then <= MAX_STEPS_AFTER_CANCEL
    stats = live.engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_held_blocks) == (0, 0, 0)
    assert stats.num_generated_tokens - generated_before < 50  # aborted long before 100
    live.engine.check_integrity()


def test_deadline_of_a_json_answer_is_a_504_that_the_openai_client_does_not_retry(
        paced: tuple[LiveServer, PacedExecutor]) -> None:
    live, executor = paced
    before, generated = cancelled(live, "deadline"), live.engine.stats().num_generated_tokens
    client = openai.OpenAI(base_url=live.v1, api_key="none", max_retries=2)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL_NAME, prompt=LONG["prompt"], max_tokens=100,
                                  temperature=0, extra_body={"ignore_eos": True},
                                  extra_headers={"X-Strata-Timeout-S": "0.4"})
    steps_then = executor.num_steps
    assert caught.value.status_code == 504
    assert caught.value.response.headers["x-should-retry"] == "false"
    error = caught.value.response.json()["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "deadline_exceeded")
    assert_freed_within_a_step(live, executor, steps_then, generated)
    assert cancelled(live, "deadline") == before + 1  # once: the client did not retry


def test_deadline_of_a_stream_ends_it_with_an_error_event(
        paced: tuple[LiveServer, PacedExecutor]) -> None:
    live, executor = paced
    before, generated = cancelled(live, "deadline"), live.engine.stats().num_generated_tokens
    response = httpx.post(f"{live.v1}/completions",
                          json=LONG | {"stream": True, "timeout": 0.5}, timeout=30)
    steps_then = executor.num_steps
    assert response.status_code == 200
    frames = [f.removeprefix("data: ") for f in response.text.strip().split("\n\n")]
    assert frames[-1] == "[DONE]"
    assert json.loads(frames[-2])["error"]["code"] == "deadline_exceeded"
    assert any("choices" in json.loads(f) for f in frames[:-2])  # tokens came before it
    assert_freed_within_a_step(live, executor, steps_then, generated)
    assert cancelled(live, "deadline") == before + 1


def test_a_client_that_leaves_a_json_answer_aborts_it(
        paced: tuple[LiveServer, PacedExecutor]) -> None:
    live, executor = paced
    before, generated = cancelled(live, "client_disconnect"), \
        live.engine.stats().num_generated_tokens
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{live.v1}/completions", json=LONG, timeout=0.5)
    assert wait_until(lambda: cancelled(live, "client_disconnect") == before + 1)
    assert_freed_within_a_step(live, executor, executor.num_steps, generated)


def test_a_client_that_leaves_a_stream_aborts_it(
        paced: tuple[LiveServer, PacedExecutor]) -> None:
    live, executor = paced
    before, generated = cancelled(live, "client_disconnect"), \
        live.engine.stats().num_generated_tokens
    with httpx.stream("POST", f"{live.v1}/completions", json=LONG | {"stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: ")
    assert wait_until(lambda: cancelled(live, "client_disconnect") == before + 1)
    assert_freed_within_a_step(live, executor, executor.num_steps, generated)


def test_a_timeout_that_is_not_seconds_is_a_400(paced: tuple[LiveServer, PacedExecutor]) -> None:
    live, _ = paced
    r = httpx.post(f"{live.v1}/completions", json=LONG, headers={"X-Strata-Timeout-S": "soon"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-strata-timeout-s"
