"""The fuzzers against real models (tests/model_stack.py): what a simulated instance never
runs, the chat template, structured output, tools, logit bias on a real vocabulary and
embeddings, takes hostile bodies and Schemathesis's cases. No 5xx, reset or hang from the
generating instance, the embed instance or the gateway in front of both."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fuzz.test_openapi_schemathesis import run_schemathesis
from harness.fuzz import run_fuzz
from harness.mutations import KINDS, MODEL_SEEDS, Mutant, Mutator
from model_stack import EMBED_MODEL, MODEL, ModelTargets, model_stack
from sim_stack import CLIENT_KEY

# three processes of real models start first (a minute on a busy machine); a real generation
# may take seconds there: the answers are judged, never timed (a hang is 30 s without one)
pytestmark = pytest.mark.timeout(600)

NUM_MUTANTS = 160  # every kind 20 times, spread over the seeds (about 20 s per target here)
AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
STRUCTURED_SEED = MODEL_SEEDS["/v1/chat/completions#json_schema"]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelTargets]:
    with model_stack(tmp_path_factory.mktemp("model-fuzz")) as running:
        yield running


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_mutated_bodies_to_a_real_model_get_answers_never_5xx_resets_or_hangs(
        real: ModelTargets, target: str) -> None:
    mutator = Mutator(seed=20261216, model_name=MODEL, seeds=MODEL_SEEDS,
                      embed_model_name=EMBED_MODEL)
    mutants = list(mutator.mutants(NUM_MUTANTS))
    assert {m.kind for m in mutants} == set(KINDS)
    assert {m.path for m in mutants} == {s.split("#")[0] for s in MODEL_SEEDS}
    report = asyncio.run(run_fuzz(real.urls[target], mutants, timeout_s=30.0,
                                  headers=AUTH))
    assert report.findings == [], real.errors()
    assert report.num_sent == NUM_MUTANTS
    assert report.counts["ok"] > 0 and report.counts["refused"] > NUM_MUTANTS // 2


def test_embedding_bodies_to_the_embed_instance_never_5xx(real: ModelTargets) -> None:
    mutator = Mutator(seed=20261217, model_name=MODEL, embed_model_name=EMBED_MODEL,
                      seeds={"/v1/embeddings": MODEL_SEEDS["/v1/embeddings"]})
    report = asyncio.run(run_fuzz(real.urls["embed"], list(mutator.mutants(80)),
                                  timeout_s=30.0, headers=AUTH))
    assert report.findings == []
    assert report.counts["ok"] > 0


@pytest.mark.parametrize("target", ["instance", "embed", "gateway"])
def test_schemathesis_finds_nothing_against_real_models(real: ModelTargets,
                                                        target: str) -> None:
    sent, failures = run_schemathesis(real.urls[target], timeout_s=30.0)
    assert failures == [], real.errors()
    assert sent > 100


def grammar_mutants(num: int) -> list[Mutant]:
    """Hostile grammars: the json_schema seed's schema mutated alone (first in the body, where a
    finding shows it), the rest of the request valid, so that most bodies reach the grammar
    compiler (a whole-body mutant seldom lands inside the schema); a mutant that is no JSON
    object any more (cut, not an object, too deep to parse here) is sent as a `guided_regex`
    instead, most of them not a valid regex."""
    schema = STRUCTURED_SEED["response_format"]["json_schema"]["schema"]
    mutator = Mutator(seed=20261218, seeds={"schema": schema})
    base = {k: v for k, v in STRUCTURED_SEED.items() if k != "response_format"} | {"model": MODEL}
    mutants = []
    for mutant in mutator.mutants(num):
        try:
            parsed = json.loads(mutant.body)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, dict):
            fields = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": "@@SCHEMA@@"}}}
            body = json.dumps(fields | base).encode().replace(b'"@@SCHEMA@@"', mutant.body)
        else:
            regex = mutant.body.decode("utf-8", errors="replace")
            body = json.dumps({"guided_regex": regex} | base).encode()
        mutants.append(Mutant(mutant.index, "/v1/chat/completions", mutant.kind, body))
    return mutants


def test_hostile_grammars_to_a_real_model_get_answers_or_400s_never_5xx(
        real: ModelTargets) -> None:
    """What llguidance refuses (a schema or regex it cannot build) is a 400 naming the field."""
    report = asyncio.run(run_fuzz(real.urls["instance"], grammar_mutants(80), timeout_s=30.0,
                                  headers=AUTH))
    assert report.findings == [], real.errors()
    assert report.counts["ok"] > 0 and report.counts["refused"] > 0, report.counts
