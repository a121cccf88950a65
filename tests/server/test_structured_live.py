"""Structured output over real sockets with the official `openai` client: response_format
(json_object, json_schema), vLLM's structured_outputs and guided_* fields, streamed and not, and
the client's `parse` helper; every answer parses and validates (jsonschema)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import openai
import pytest
from live_server import MODEL_NAME, LiveServer
from pydantic import BaseModel, Field

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                   "code": {"type": "string", "maxLength": 5},
                   "rank": {"type": "integer", "minimum": 1, "maximum": 9},
                   "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["city", "code", "rank", "tags"], "additionalProperties": False,
}
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a city as JSON."}]
SAMPLING = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.2, "seed": 2}]


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def json_schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                                   "strict": True}}


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seed1", "seed2"])
def test_json_schema_answers_validate(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2,
                                       response_format=json_schema_format(SCHEMA), **sampling)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_streamed_json_schema_answer_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                            response_format=json_schema_format(SCHEMA), seed=5)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_take_response_format_and_structured_outputs(
        client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="JSON:", max_tokens=100, seed=3,
                                  extra_body={"response_format": json_schema_format(SCHEMA)})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=MODEL_NAME, prompt="A code:", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text)


@pytest.mark.parametrize(("body", "check"), [
    ({"guided_regex": r"\d{3}-[a-z]{3}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{3}", t)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"json": SCHEMA}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "<" [0-9]+ ">"'}},
     lambda t: re.fullmatch("<[0-9]+>", t)),
])
def test_vllm_fields(client: openai.OpenAI, body: dict[str, Any], check: Any) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=4,
                                       extra_body=body)
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].message.content), r.choices[0].message.content


def test_json_object_is_an_object(client: openai.OpenAI, live: LiveServer) -> None:
    closing = {str(ord('"')): 6, str(ord("}")): 6}  # byte tokens close a random model's keys
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=6,
                                       response_format={"type": "json_object"},
                                       logit_bias=closing)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


class City(BaseModel):
    city: Literal["Paris", "Rome"]
    code: Annotated[str, Field(max_length=4)]
    rank: Annotated[int, Field(ge=1, le=5)]


def test_the_client_parse_helper(client: openai.OpenAI) -> None:
    for seed in (1, 2):
        r = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES,
                                          response_format=City, seed=seed)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, City) and 1 <= parsed.rank <= 5 and len(parsed.code) <= 4


def test_the_client_stream_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES,
                                        response_format=City, seed=3) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, None),
    ({"response_format": {"type": "xml"}}, None),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, None),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, None),
])
def test_bad_or_conflicting_requests_are_400(live: LiveServer, body: dict[str, Any],
                                             param: str | None) -> None:
    r = httpx.post(f"{live.v1}/chat/completions",
                   json={"model": MODEL_NAME, "messages": MESSAGES} | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
