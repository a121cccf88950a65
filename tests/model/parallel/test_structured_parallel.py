"""Structured output over parallel ranks: T=2 (rank 0 samples: its own constraints, masks
beside the forward) and P=2 (the last stage samples: constraints reach it as pickled mask
snapshots) give the tokens one process gives, and every answer validates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from model.parallel.parallel_helpers import make_engine, parallel_executor

from strata.engine.engine import Engine
from strata.engine.executor import ModelExecutor
from strata.engine.request import Request, RequestStatus, SamplingParams
from strata.model.executor import TorchExecutor
from strata.model.grammar import Grammars, GrammarSpec
from strata.model.loader import LoadedModel, load_model
from strata.model.parallel.shard_loader import prepare_model
from strata.types import RequestId

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 5},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999},
                   "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["word", "n", "flags"], "additionalProperties": False,
}
OPTIONS: list[dict[str, Any]] = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                                 {"temperature": 0.8, "top_k": 20, "seed": 4}]


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, dtype="float32")


def run(executor: ModelExecutor, loaded: LoadedModel) -> list[tuple[list[int], str]]:
    grammars = Grammars(loaded.tokenizer, loaded.config.vocab_size)
    specs = [GrammarSpec("json_schema", json.dumps(SCHEMA)), GrammarSpec("regex", "[a-z]{3,6}")]
    engine: Engine = make_engine(executor, loaded.config.vocab_size)
    requests = []
    for i, (spec, options) in enumerate((s, o) for s in specs for o in OPTIONS):
        constraint = grammars.constraint(grammars.compile(spec))
        params = SamplingParams(max_tokens=80, constraint=constraint, **options)
        requests.append(Request(RequestId(f"s{i}"), [5 + i, 17, 40 + i], params,
                                eos_token_ids=loaded.tokenizer.eos_token_ids))
        engine.add_request(requests[-1])
    tokens: dict[RequestId, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert all(r.status == RequestStatus.FINISHED_STOPPED for r in requests)
    return [(tokens[r.request_id], loaded.tokenizer.decode(tokens[r.request_id]))
            for r in requests]


@pytest.mark.parametrize(("tensor", "pipeline"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_ranks_constrain_as_one_process(model_dir: Path, loaded: LoadedModel,
                                                 tensor: int, pipeline: int) -> None:
    reference = run(TorchExecutor(loaded.config, loaded.weights, dtype="float32"), loaded)
    executor = parallel_executor(prepare_model(model_dir, dtype="float32", cache_dir=None),
                                 tensor, pipeline)
    try:
        got = run(executor, loaded)
    finally:
        executor.shutdown()
    assert [g[0] for g in got] == [r[0] for r in reference]
    half = len(OPTIONS)
    for _, text in got[:half]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(text.isalpha() and 3 <= len(text) <= 6 for _, text in got[half:])
