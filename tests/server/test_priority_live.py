"""Priority on a real instance: the body's class or `X-Priority`, clamped by the API key's
ceiling, reaches the engine, whose scheduler preempts the lower request at the slot cap."""

from __future__ import annotations

import threading

import httpx
from live_server import MODEL_NAME, GatedExecutor, start_server, wait_until

from strata.model.loader import LoadedModel


def test_an_interactive_request_overtakes_a_clamped_batch_one(tiny_model: LoadedModel) -> None:
    gate: list[GatedExecutor] = []
    server = start_server(tiny_model, max_num_seqs=1, api_keys=("k-batch", "k-any"),
                          key_max_priority=(("k-batch", -10),),
                          wrap=lambda inner: gate.append(GatedExecutor(inner)) or gate[0])
    finished: list[str] = []

    def send(name: str, key: str, max_tokens: int, **kwargs: object) -> None:
        body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": max_tokens,
                "ignore_eos": True, **kwargs.pop("body", {})}  # type: ignore[dict-item]
        answer = httpx.post(f"{server.v1}/completions", json=body, timeout=60,
                            headers={"authorization": f"Bearer {key}",
                                     **kwargs.pop("headers", {})})  # type: ignore[dict-item]
        assert answer.status_code == 200, answer.text
        finished.append(name)

    try:
        gate[0].hold()
        # asks for interactive in its body, but its key's ceiling is batch
        slow = threading.Thread(target=send, args=("batch", "k-batch", 40),
                                kwargs={"body": {"priority": "interactive"}})
        slow.start()
        assert wait_until(lambda: gate[0].num_blocked == 1)  # its prompt is in the engine
        fast = threading.Thread(target=send, args=("interactive", "k-any", 2),
                                kwargs={"headers": {"x-priority": "interactive"},
                                        "body": {"priority": "sheddable"}})
        fast.start()
        assert wait_until(lambda: server.async_engine.num_in_flight == 2)
        gate[0].open()
        fast.join(60)
        slow.join(60)
        assert finished == ["interactive", "batch"]
        stats = server.engine.stats()
        assert (stats.num_preemptions, stats.num_priority_preemptions) == (1, 1)
    finally:
        server.stop()


def test_an_unknown_class_is_a_400_naming_the_classes(tiny_model: LoadedModel) -> None:
    server = start_server(tiny_model)
    try:
        answer = httpx.post(f"{server.v1}/completions", json={
            "model": MODEL_NAME, "prompt": "hi", "max_tokens": 1, "priority": "urgent"})
        assert answer.status_code == 400
        assert "interactive, standard, batch, sheddable" in answer.json()["error"]["message"]
        answer = httpx.post(f"{server.v1}/completions", headers={"x-priority": "9999"},
                            json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1})
        assert answer.status_code == 400
    finally:
        server.stop()
