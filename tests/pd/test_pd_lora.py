"""The hand-off with a LoRA adapter (float32 greedy, live instances, the gateway's two calls made
by the test): P and D both serve `lora-a`.

A disaggregated request with `model: lora-a` answers token for token as one mixed instance with
the adapter (and not as the base). The handed-off blocks are named by the adapter's digest: on
D (and on P) the same prompt on the base gets no cached tokens from them, while the adapter's
own repeat does. A D without the adapter refuses the request by name (404), never decoding on
the base weights; a D whose `lora-a` is other files ignores the handle and prefills itself, so
its answer is its own adapter's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from live_server import wait_until
from lora_fixtures import make_models
from pd_fleet import MODEL, Instance, comparable, decode, mixed, prefill, start_instance

from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.model.lora import load_adapter

PATH = "/v1/completions"
PROMPT = [(7 * i + 3) % 250 for i in range(21)]  # two full blocks of 8 and a partial one


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("pd-lora"))


@pytest.fixture(scope="module")
def fleet(paths: dict[str, Path]) -> Iterator[dict[str, Instance]]:
    model = load_model(paths["base"], dtype="float32")
    served = {"p": "a", "d": "a", "m": "a", "bare": None, "other": "b"}  # lora-a is these files
    instances = {name: instance_with(model, paths[files] if files else None)
                 for name, files in served.items()}
    yield instances
    for instance in instances.values():
        instance.stop()


def instance_with(model: LoadedModel, adapter: Path | None) -> Instance:
    executor = TorchExecutor(model.config, model.weights, dtype="float32", model_name=MODEL,
                             model_version="v1")
    loras = {}
    if adapter is not None:
        loras["lora-a"] = executor.add_lora(load_adapter("lora-a", adapter, model.config))
    return start_instance(model, executor=executor, loras=loras)


def body(model: str, n: int = 0) -> dict[str, Any]:
    return {"model": model, "prompt": [n, *PROMPT], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_an_adapter_hand_off_answers_as_a_mixed_instance_with_it(
        fleet: dict[str, Instance]) -> None:
    p, d, m = fleet["p"], fleet["d"], fleet["m"]
    want = mixed(m, body("lora-a", 1), PATH).json()
    assert want["choices"][0]["text"] != mixed(m, body(MODEL, 1), PATH).json()["choices"][0][
        "text"]  # else this proves nothing
    pulled = d.metric("pd_handoffs_total", side="decode", outcome="pulled")
    answer = decode(d, body("lora-a", 1), prefill(p, body("lora-a", 1), PATH), PATH)
    assert answer.status_code == 200, answer.text
    assert comparable(answer.json()) == comparable(want)
    assert d.metric("pd_handoffs_total", side="decode", outcome="pulled") == pulled + 1
    assert wait_until(lambda: p.num_held_blocks == 0)


def test_the_handed_off_blocks_are_the_adapters_own(fleet: dict[str, Instance]) -> None:
    p, d = fleet["p"], fleet["d"]
    answer = decode(d, body("lora-a", 2), prefill(p, body("lora-a", 2), PATH), PATH)
    assert answer.status_code == 200, answer.text
    for instance in (d, p):  # D imported them, P computed them: both under the adapter's digest
        base = mixed(instance, body(MODEL, 2), PATH).json()
        assert cached(base) == 0
        assert cached(mixed(instance, body("lora-a", 2), PATH).json()) == 16


def test_a_decode_instance_without_the_adapter_refuses_it_by_name(
        fleet: dict[str, Instance]) -> None:
    handle = prefill(fleet["p"], body("lora-a", 3), PATH)
    answer = decode(fleet["bare"], body("lora-a", 3), handle, PATH)
    assert answer.status_code == 404, answer.text
    assert answer.json()["error"]["code"] == "model_not_found"
    assert "lora-a" in answer.json()["error"]["message"]


def test_a_decode_instance_with_other_files_for_the_name_prefills_itself(
        fleet: dict[str, Instance]) -> None:
    other = fleet["other"]
    handle = prefill(fleet["p"], body("lora-a", 4), PATH)
    local = other.metric("pd_handoffs_total", side="decode", outcome="local")
    answer = decode(other, body("lora-a", 4), handle, PATH)
    assert answer.status_code == 200, answer.text
    assert other.metric("pd_handoffs_total", side="decode", outcome="local") == local + 1
    text = answer.json()["choices"][0]["text"]
    assert text == mixed(other, body("lora-a", 4), PATH).json()["choices"][0]["text"]
    assert text != mixed(fleet["m"], body("lora-a", 4), PATH).json()["choices"][0]["text"]
