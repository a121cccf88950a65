"""`strata serve --tensor-parallel-size 2 --lora-modules` as a real process, called with the
official `openai` client (and httpx for the admin routes, which the client has no method for).

The nine-head tiny model (T=2 splits its heads 5 + 4 around a shared KV head), float32: a
--lora-modules adapter and one loaded at run time (POST /v1/load_lora_adapter reaches both
ranks) give one process's greedy answers (text, and each token's logprob within 1e-4: the tiny
model samples ids its tokenizer decodes to nothing), alone and with the base in flight at once;
unloaded,
the name is 404 and loading it back serves it again; bad adapters are refused by name, with the
400 a one-process instance gives (tests/lora/test_lora_load.py), and the instance goes on.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import ServeProcess, start_serve

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.request import Request, SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.loader import load_model
from strata.model.lora import load_adapter
from strata.types import RequestId

pytestmark = pytest.mark.needs("shm")
N = 6
PROMPT = [(7 * i + 3) % 250 for i in range(13)]


@pytest.fixture(scope="module")
def server(nine_head_loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServeProcess]:
    proc = start_serve([str(nine_head_loras["base"]), "--served-model-name", "tiny",
                        "--tensor-parallel-size", "2", "--dtype", "float32", "--block-size",
                        "4", "--kv-cache-gb", "0.01", "--max-lora-rank", "4", "--log-level",
                        "warning", "--lora-modules", f"start-a={nine_head_loras['a']}"],
                       cache_dir=tmp_path_factory.mktemp("cache"), timeout_s=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@dataclass
class Answer:
    text: str
    logprobs: list[float]


@pytest.fixture(scope="module")
def one_process(nine_head_loras: dict[str, Path]) -> dict[str, Answer]:
    """Greedy answers to PROMPT by one process (T=1), float32: on the base, A and B."""
    loaded = load_model(nine_head_loras["base"], dtype="float32")
    executor = TorchExecutor(loaded.config, loaded.weights, dtype="float32")
    digests = {n: executor.add_lora(load_adapter(n, nine_head_loras[n], loaded.config))
               for n in ("a", "b")}
    engine = Engine(executor, CacheConfig(block_size=4, num_blocks=64),
                    SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                    loaded.tokenizer, vocab_size=loaded.config.vocab_size)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=1)
    for name in ("", "a", "b"):
        engine.add_request(Request(RequestId(name or "base"), list(PROMPT), params,
                                   lora_name=name, lora_digest=digests.get(name, "")))
    tokens: dict[str, list[int]] = {"base": [], "a": [], "b": []}
    logprobs: dict[str, list[float]] = {"base": [], "a": [], "b": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.new_logprobs]
    assert len({tuple(t) for t in tokens.values()}) == 3  # three different answers
    return {n: Answer(loaded.tokenizer.decode(t), logprobs[n]) for n, t in tokens.items()}


def admin(server: ServeProcess, route: str, **body: str) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}_lora_adapter", json=body, timeout=60)


def answer(client: openai.OpenAI, model: str) -> Answer:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    assert r.model == model and r.choices[0].logprobs is not None
    return Answer(r.choices[0].text, [float(x or 0.0) for x in
                                      r.choices[0].logprobs.token_logprobs or []])


def assert_same(got: Answer, want: Answer, what: str = "") -> None:
    assert got.text == want.text, what
    assert len(got.logprobs) == len(want.logprobs) == N, what
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-4, what


def test_a_start_adapter_gives_one_process_answers_beside_the_base(
        client: openai.OpenAI, one_process: dict[str, Answer]) -> None:
    want = {"tiny": one_process["base"], "start-a": one_process["a"]}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda m: (m, answer(client, m)), [*want, *want]))
    for model, found in got:
        assert_same(found, want[model], model)


def test_load_serve_unload_and_load_back_at_run_time(
        server: ServeProcess, client: openai.OpenAI, nine_head_loras: dict[str, Path],
        one_process: dict[str, Answer]) -> None:
    loaded = admin(server, "load", lora_name="dyn-b", lora_path=str(nine_head_loras["b"]))
    assert loaded.status_code == 400 and "rank 8 is over the limit --max-lora-rank 4" in \
        loaded.json()["error"]["message"]  # B is r=8: this instance takes r <= 4
    loaded = admin(server, "load", lora_name="dyn-a", lora_path=str(nine_head_loras["a"]))
    assert loaded.status_code == 200 and "added" in loaded.text, loaded.text
    assert {m.id for m in client.models.list().data} == {"tiny", "start-a", "dyn-a"}
    assert_same(answer(client, "dyn-a"), one_process["a"])
    assert admin(server, "unload", lora_name="dyn-a").status_code == 200
    with pytest.raises(openai.NotFoundError, match="dyn-a"):
        answer(client, "dyn-a")
    assert admin(server, "load", lora_name="dyn-a",
                 lora_path=str(nine_head_loras["a"])).status_code == 200
    assert_same(answer(client, "dyn-a"), one_process["a"])
    assert admin(server, "unload", lora_name="dyn-a").status_code == 200


def test_bad_adapters_are_refused_by_name_and_the_instance_goes_on(
        server: ServeProcess, client: openai.OpenAI, nine_head_loras: dict[str, Path],
        tmp_path: Path, one_process: dict[str, Answer]) -> None:
    odd = Path(shutil.copytree(nine_head_loras["a"], tmp_path / "odd"))
    cfg = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head"]}))
    refusals = {str(odd): "LoRA adapter 'x' refused: target modules ['lm_head'] are not "
                          "supported",
                "/no/such/dir": "LoRA adapter 'x' at '/no/such/dir' cannot be read"}
    for path, message in refusals.items():
        r = admin(server, "load", lora_name="x", lora_path=path)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
    assert_same(answer(client, "start-a"), one_process["a"])
