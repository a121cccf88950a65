"""Structured output in the engine on a tiny random model: every answer parses and validates
(jsonschema), greedy and sampled; masks are computed on the mask thread beside the forward; a
constraint pickles as its mask for another pipeline stage; refused tokens end the request."""

from __future__ import annotations

import json
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from engine_fakes import run_to_completion
from tiny_models import make_tiny_model_dir

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelInput, ScheduledSequence
from strata.engine.request import Request, RequestStatus, SamplingParams
from strata.errors import InvalidRequestError
from strata.model.executor import TorchExecutor
from strata.model.grammar import Grammars, GrammarSpec, MaskSnapshot, choice_lark
from strata.model.loader import LoadedModel, load_model
from strata.model.masks import allowed_tokens
from strata.types import RequestId

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object",
     "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                             "minItems": 1, "maxItems": 3},
                    "level": {"enum": ["low", "high"]},
                    "nested": {"type": "object", "properties": {"x": {"type": "number"}},
                               "required": ["x"], "additionalProperties": False}},
     "required": ["tags", "level", "nested"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("so") / "m", initializer_range=0.2)
    return load_model(Path(path), dtype="float32")


@pytest.fixture(scope="module")
def grammars(tiny: LoadedModel) -> Grammars:
    return Grammars(tiny.tokenizer, tiny.config.vocab_size)


def engine_of(model: LoadedModel) -> Engine:
    return Engine(TorchExecutor(model.config, model.weights, dtype="float32"),
                  CacheConfig(block_size=8, num_blocks=256),
                  SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                  max_model_len=256),
                  model.tokenizer, vocab_size=model.config.vocab_size)


def generate(model: LoadedModel, grammars: Grammars, spec: GrammarSpec,
             params: list[dict[str, Any]]) -> list[tuple[str, RequestStatus]]:
    engine = engine_of(model)
    compiled = grammars.compile(spec)
    eos = model.tokenizer.eos_token_ids
    requests = []
    for i, options in enumerate(params):
        sp = SamplingParams(max_tokens=150, constraint=grammars.constraint(compiled),
                            **options)
        requests.append(Request(RequestId(f"r{i}"), model.tokenizer.encode(f"prompt {i}:"), sp,
                                eos_token_ids=eos))
        engine.add_request(requests[-1])
    texts = streamed_texts(engine)
    return [(texts[r.request_id], r.status) for r in requests]


def streamed_texts(engine: Engine) -> dict[RequestId, str]:
    """The text each request streamed (what a client sees), stepping until idle."""
    texts: dict[RequestId, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
    engine.check_integrity()
    return texts


SAMPLED = [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": s} for s in range(4)] + [
    {"temperature": 1.3, "top_p": 0.9, "seed": 9}, {"temperature": 0.7, "top_k": 5, "seed": 2}]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested-enums", "array"])
def test_every_answer_validates_greedy_and_sampled(tiny: LoadedModel, grammars: Grammars,
                                                   schema: dict[str, Any]) -> None:
    spec = GrammarSpec("json_schema", json.dumps(schema))
    for text, status in generate(tiny, grammars, spec, SAMPLED):
        assert status == RequestStatus.FINISHED_STOPPED, text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_ebnf(tiny: LoadedModel, grammars: Grammars) -> None:
    two = SAMPLED[:3]
    closing = {"logit_bias": ((ord('"'), 6.0), (ord("}"), 6.0))}  # byte tokens: id = byte
    for text, status in generate(tiny, grammars, GrammarSpec("json_object"),
                                 [p | closing for p in two]):
        assert status == RequestStatus.FINISHED_STOPPED and isinstance(json.loads(text), dict)
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for text, _ in generate(tiny, grammars, GrammarSpec("regex", pattern), two):
        assert re.fullmatch(pattern, text), text
    choices = ["yes", "no", 'say "é"\n']
    for text, _ in generate(tiny, grammars, GrammarSpec.choice(choices, "guided_choice"), two):
        assert text in choices
    for grammar in ('root ::= "(" [a-c]+ ")"', 'start: "(" /[a-c]+/ ")"'):  # GBNF, Lark
        for text, _ in generate(tiny, grammars, GrammarSpec("grammar", grammar), two):
            assert re.fullmatch(r"\([a-c]+\)", text), text


def test_a_bad_schema_or_regex_is_a_400_naming_the_field(grammars: Grammars) -> None:
    with pytest.raises(InvalidRequestError) as info:
        grammars.compile(GrammarSpec("json_schema", '{"type": "nonsense"}', "guided_json"))
    assert info.value.param == "guided_json" and "nonsense" in str(info.value)
    with pytest.raises(InvalidRequestError):
        grammars.compile(GrammarSpec("regex", "(unclosed", "guided_regex"))
    with pytest.raises(ValueError):
        choice_lark([])
    with pytest.raises(InvalidRequestError) as info:
        grammars.compile(GrammarSpec("choice", "[]", "guided_choice"))
    assert info.value.param == "guided_choice"


def test_special_tokens_are_never_allowed_and_stops_only_at_the_end(
        tiny: LoadedModel, grammars: Grammars) -> None:
    eos = tiny.tokenizer.eos_token_ids
    constraint = grammars.constraint(grammars.compile(GrammarSpec("json_object")))
    vocab = tiny.config.vocab_size
    special = {tiny.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|endoftext|>",
                                                       "<|im_end|>")}
    for token in tiny.tokenizer.encode('{"a": [1, "x"]}'):
        allowed = allowed_tokens([constraint], vocab)[0]
        assert allowed[token] and not any(allowed[t] for t in special)
        assert constraint.accept(token)
    assert constraint.is_terminated  # the object is closed: only EOS may follow
    assert set(allowed_tokens([constraint], vocab)[0].nonzero().flatten().tolist()) == set(eos)
    assert not constraint.accept(tiny.tokenizer.encode("x")[0])


def test_masks_are_filled_on_the_mask_thread(tiny: LoadedModel, grammars: Grammars) -> None:
    inner = grammars.constraint(grammars.compile(GrammarSpec("regex", "[ab]{4}")))
    threads: list[str] = []

    class Spy:
        def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
            threads.append(threading.current_thread().name)
            inner.fill_bitmask(bitmask, row)

        def accept(self, token_id: int) -> bool:
            return inner.accept(token_id)

        @property
        def is_terminated(self) -> bool:
            return inner.is_terminated

    engine = engine_of(tiny)
    engine.add_request(Request(RequestId("s"), [5, 6, 7], SamplingParams(
        max_tokens=10, temperature=0.0, constraint=Spy()), eos_token_ids=(272,)))
    text = streamed_texts(engine)[RequestId("s")]
    # four masks: the fourth letter completes the grammar, which ends the request at once
    assert re.fullmatch("[ab]{4}", text) and len(threads) == 4
    assert set(threads) == {"strata-masks_0"} and threading.current_thread().name not in threads


def test_a_constraint_pickles_as_its_current_mask(tiny: LoadedModel,
                                                  grammars: Grammars) -> None:
    constraint = grammars.constraint(grammars.compile(GrammarSpec("regex", "ab|ac")))
    assert constraint.accept(tiny.tokenizer.encode("a")[0])
    seq = ScheduledSequence(RequestId("p"), [1], 0, [0], True,
                            SamplingParams(constraint=constraint), [], [1])
    shipped = pickle.loads(pickle.dumps(ModelInput([seq], 8)))
    snapshot = shipped.sequences[0].sampling_params.constraint
    assert isinstance(snapshot, MaskSnapshot)
    vocab = tiny.config.vocab_size
    expected = allowed_tokens([constraint], vocab)
    assert (allowed_tokens([snapshot], vocab) == expected).all()
    assert sorted(expected[0].nonzero().flatten().tolist()) == [98, 99]  # "b" and "c"


def test_a_refused_token_ends_the_request_with_an_error(tiny: LoadedModel) -> None:
    class Refuses:
        def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
            bitmask[row] = -1  # everything allowed, yet nothing accepted

        def accept(self, token_id: int) -> bool:
            return False

        is_terminated = False

    engine = engine_of(tiny)
    request = Request(RequestId("x"), [5, 6], SamplingParams(max_tokens=5, constraint=Refuses()))
    engine.add_request(request)
    assert len(run_to_completion(engine)[RequestId("x")]) == 1
    assert request.status == RequestStatus.FINISHED_ERROR
