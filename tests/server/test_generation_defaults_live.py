"""The model's sampling defaults over real sockets (openai client): a request that leaves a
field out gets the model's value, an explicit value wins, /v1/models shows them; with none set
(`--generation-config none`) Strata's own defaults apply."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import openai
import pytest
from live_server import MODEL_NAME, LiveServer, start_server

from strata.commands.serve import add_parser
from strata.model.fetch import KNOWN_MODELS
from strata.model.generation_defaults import GenerationDefaults, generation_defaults_of
from strata.model.loader import LoadedModel

DEFAULTS = GenerationDefaults(temperature=0.0, max_tokens=4)
MESSAGES: list[object] = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def live(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    server = start_server(tiny_model, generation_defaults=DEFAULTS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def test_models_show_the_defaults(client: openai.OpenAI) -> None:
    card = client.models.list().data[0]
    assert card.model_extra == {"max_model_len": 128, "task": "generate", "deterministic": False,
                                "generation_defaults": {"temperature": 0.0, "max_tokens": 4}}


def test_left_out_fields_take_the_model_defaults(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=3, seed=1)
    texts = {c.message.content for c in r.choices}
    assert len(texts) == 1  # greedy: every seed gives the same answer
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage is not None and r.usage.completion_tokens == 3 * 4
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                            temperature=0.0, max_tokens=4)
    assert texts == {greedy.choices[0].message.content}
    c = client.completions.create(model=MODEL_NAME, prompt="abc")
    assert c.usage is not None and c.usage.completion_tokens == 4  # not OpenAI's 16


def test_explicit_fields_win(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=4, seed=1,
                                       temperature=1.5, max_tokens=10)
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not greedy
    assert r.usage is not None and r.usage.completion_tokens > 4 * 4


def test_the_flag_turns_them_off() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).generation_config == "auto"
    assert parser.parse_args(["serve", "--generation-config", "none"]).generation_config == "none"


def test_a_known_alias_brings_defaults_when_its_file_sets_none() -> None:
    smollm2 = KNOWN_MODELS["smollm2"].generation_defaults
    assert smollm2.as_dict() == {"temperature": 0.2, "top_p": 0.9}  # its model card's
    none = GenerationDefaults()
    assert generation_defaults_of("auto", none, smollm2) == smollm2
    assert generation_defaults_of("auto", DEFAULTS, smollm2) == DEFAULTS  # the file's win
    assert generation_defaults_of("auto", none, None) == none
    assert generation_defaults_of("none", DEFAULTS, smollm2) == none
