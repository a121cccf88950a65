"""Two engines over the real TorchExecutor: KV exported by A and imported by B gives B the tokens
A gets from its own prefix cache (bit-identical KV), and in float32 the tokens of recomputing."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_fakes import run_to_completion
from tiny_models import make_tiny_model_dir

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.outputs import RequestOutput
from strata.engine.request import Request, SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.types import BlockHash, RequestId

PROMPT = [(13 * i + 7) % 250 for i in range(45)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("kvoff") / "m", initializer_range=0.2)
    return load_model(Path(path), dtype="float32")


def make_engine(model: LoadedModel, dtype: str, version: str = "v1") -> Engine:
    executor = TorchExecutor(model.config, model.weights, dtype=dtype, model_name="tiny",
                             model_version=version)
    return Engine(executor, CacheConfig(block_size=4, num_blocks=64, namespace=f"tiny@{version}"),
                  SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
                  model.tokenizer, vocab_size=model.config.vocab_size)


def request(name: str, prompt: list[int], **fields: object) -> Request:
    req = Request(RequestId(name), list(prompt),
                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for key, value in fields.items():
        setattr(req, key, value)
    return req


def first_turn(engine: Engine) -> tuple[list[int], list[tuple[BlockHash, bytes]]]:
    engine.add_request(request("t1", PROMPT, kv_export=True))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.check_integrity()
    return [t for o in outputs for t in o.new_token_ids], outputs[-1].kv_blocks


def second(engine: Engine, prompt: list[int], **fields: object) -> tuple[list[int], int]:
    engine.add_request(request("t2", prompt, **fields))
    tokens = run_to_completion(engine)[RequestId("t2")]
    return tokens, engine.stats().num_external_hit_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fetched_kv_gives_the_tokens_of_a_local_prefix_hit(tiny: LoadedModel, dtype: str) -> None:
    a = make_engine(tiny, dtype)
    answer, blocks = first_turn(a)
    assert len(blocks) == (45 + 6 - 1) // 4
    prompt2 = PROMPT + answer + [5, 6, 7]
    local, _ = second(a, prompt2)
    fetched, num_external = second(make_engine(tiny, dtype), prompt2, external_kv=dict(blocks))
    assert num_external == len(blocks) * 4
    assert fetched == local
    if dtype == "float32":
        recomputed, _ = second(make_engine(tiny, dtype), prompt2)
        assert fetched == recomputed


def test_kv_of_another_version_is_neither_matched_nor_imported(tiny: LoadedModel) -> None:
    _, blocks = first_turn(make_engine(tiny, "float32", version="v1"))
    other = make_engine(tiny, "float32", version="v2")
    _, num_external = second(other, PROMPT + [1, 2, 3], external_kv=dict(blocks))
    assert num_external == 0
    # even under the right hashes, v1 payloads are refused by a v2 executor (then recomputed)
    fresh = make_engine(tiny, "float32", version="v2")
    hashes = fresh.block_hashes(PROMPT)
    forged = {h: payload for h, (_, payload) in zip(hashes, blocks, strict=False)}
    _, num_external = second(fresh, PROMPT, external_kv=forged)
    assert num_external == 0 and fresh.stats().num_kv_import_failures == 1
