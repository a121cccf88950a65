"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter on a real `strata serve` process with
keys (the admin key loads; a client key generates).

A loaded adapter gives HF+PEFT's tokens; loading the same files again changes nothing; a name
reloaded with other weights never hits the KV cached under the old ones; streams in flight when
their adapter is unloaded finish on it (0 failed), later requests get 404; bad adapters, the
base's name and unknown names are refused with the adapter's message; a client key is refused.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_fixtures import hf_greedy, make_adapter, make_models
from serve_process import ServeProcess, start_serve

ADMIN, CLIENT = "lora-admin-key", "lora-client-key"
N = 6
PROMPT = [(7 * i + 3) % 250 for i in range(13)]
LONG = [(5 * i + 1) % 250 for i in range(24)]  # six full blocks of 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-load")
    found = make_models(root)
    found["big"] = make_adapter(found["base"], root / "lora-big", seed=3, r=16, alpha=16,
                                targets=["q_proj"])
    odd = Path(shutil.copytree(found["a"], root / "lora-odd"))
    cfg = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    found["odd"] = odd
    return found


@pytest.fixture(scope="module")
def server(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("keys")
    (root / "keys").write_text(CLIENT + "\n")
    (root / "admin").write_text(ADMIN + "\n")
    proc = start_serve([str(paths["base"]), "--served-model-name", "tiny", "--dtype", "float32",
                        "--block-size", "4", "--kv-cache-gb", "0.01", "--max-lora-rank", "8",
                        "--lora-modules", f"start-a={paths['a']}",
                        "--api-key-file", str(root / "keys"), "--admin-key-file",
                        str(root / "admin")],
                       cache_dir=tmp_path_factory.mktemp("cache"), timeout_s=120)
    yield proc
    proc.stop()


def admin(server: ServeProcess, route: str, **body: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}_lora_adapter", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN}"})


def complete(server: ServeProcess, model: str, prompt: list[int], n: int = N) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {CLIENT}"},
                   json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return dict(r.json())


def text_of(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def detok(server: ServeProcess, ids: list[int]) -> str:
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30,
                   headers={"Authorization": f"Bearer {CLIENT}"})
    return str(r.json()["prompt"])


def test_a_loaded_adapter_gives_peft_tokens_and_a_reload_of_its_files_is_a_no_op(
        server: ServeProcess, paths: dict[str, Path]) -> None:
    r = admin(server, "load", lora_name="dyn-b", lora_path=str(paths["b"]))
    assert r.status_code == 200 and "added" in r.text, r.text
    want = hf_greedy(paths["base"], paths["b"], PROMPT, N)
    assert text_of(complete(server, "dyn-b", PROMPT)) == detok(server, want)
    again = admin(server, "load", lora_name="dyn-b", lora_path=str(paths["b"]))
    assert again.status_code == 200 and "already loaded" in again.text, again.text
    models = httpx.get(f"{server.url}/v1/models", timeout=30,
                       headers={"Authorization": f"Bearer {CLIENT}"}).json()["data"]
    assert {m["id"]: m.get("parent") for m in models} == {
        "tiny": None, "start-a": "tiny", "dyn-b": "tiny"}
    assert [m["deterministic"] for m in models] == [False] * 3  # served without --deterministic
    assert admin(server, "unload", lora_name="dyn-b").status_code == 200


def test_a_name_reloaded_with_other_weights_never_hits_the_old_kv(
        server: ServeProcess, paths: dict[str, Path]) -> None:
    assert admin(server, "load", lora_name="swap", lora_path=str(paths["a"])).status_code == 200
    old = complete(server, "swap", LONG)
    assert cached(complete(server, "swap", LONG)) == 20  # cached under the old weights
    assert text_of(old) == detok(server, hf_greedy(paths["base"], paths["a"], LONG, N))
    assert admin(server, "load", lora_name="swap", lora_path=str(paths["b"])).status_code == 200
    new = complete(server, "swap", LONG)
    assert cached(new) == 0
    assert text_of(new) == detok(server, hf_greedy(paths["base"], paths["b"], LONG, N))
    assert text_of(new) != text_of(old)
    assert admin(server, "unload", lora_name="swap").status_code == 200


def test_unload_under_load_fails_no_request(server: ServeProcess, paths: dict[str, Path]
                                            ) -> None:
    """Eight streams on `gone` (and two on the base) are under way when it is unloaded: each
    finishes with the adapter's tokens (those of the same files given at start); a request
    sent after the unload gets 404."""
    assert admin(server, "load", lora_name="gone", lora_path=str(paths["a"])).status_code == 200
    n = 96
    want = {m: text_of(complete(server, m, PROMPT, n)) for m in ("start-a", "tiny")}
    started = threading.Barrier(11)
    unloaded_at: list[float] = []

    def stream(model: str) -> tuple[str, str, float]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        parts, last = [], 0.0
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {CLIENT}"}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not parts:
                    started.wait(60)
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                parts.append(chunk["choices"][0]["text"] if chunk["choices"] else "")
                last = time.monotonic()
        return model, "".join(parts), last

    with ThreadPoolExecutor(10) as pool:
        streams = [pool.submit(stream, m) for m in ["gone"] * 8 + ["tiny"] * 2]
        started.wait(60)
        assert admin(server, "unload", lora_name="gone").status_code == 200
        unloaded_at.append(time.monotonic())
        results = [s.result() for s in streams]
    for model, text, _ in results:
        assert text == want["start-a" if model == "gone" else "tiny"], model
    assert max(last for _, _, last in results) > unloaded_at[0]  # streamed after the unload
    after = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       headers={"Authorization": f"Bearer {CLIENT}"},
                       json={"model": "gone", "prompt": PROMPT, "max_tokens": 1})
    assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "'x' at '/no/such/dir' cannot be read"),
    ({"lora_name": "x", "lora_path": "big"}, 400, "rank 16 is over the limit --max-lora-rank 8"),
    ({"lora_name": "x", "lora_path": "odd"}, 400, "target modules ['lm_head'] are not supported"),
    ({"lora_name": "tiny", "lora_path": "a"}, 400, "'tiny' is the base model's name"),
    ({"lora_name": "never-loaded"}, 404, "`never-loaded` is not loaded"),
])
def test_refusals_name_the_problem(server: ServeProcess, paths: dict[str, Path],
                                   body: dict[str, str], status: int, message: str) -> None:
    if "lora_path" in body:
        path = body["lora_path"]
        r = admin(server, "load", lora_name=body["lora_name"],
                  lora_path=str(paths[path]) if path in paths else path)
    else:
        r = admin(server, "unload", **body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_a_client_key_can_neither_load_nor_unload(server: ServeProcess,
                                                  paths: dict[str, Path]) -> None:
    for route, body in (("load", {"lora_name": "c", "lora_path": str(paths["a"])}),
                        ("unload", {"lora_name": "start-a"})):
        url = f"{server.url}/v1/{route}_lora_adapter"
        refused = httpx.post(url, json=body, headers={"Authorization": f"Bearer {CLIENT}"})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "insufficient_permissions"
        assert httpx.post(url, json=body).status_code == 401
    assert text_of(complete(server, "start-a", PROMPT))  # still served
