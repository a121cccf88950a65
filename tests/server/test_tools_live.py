"""Tool calls over real sockets with the official `openai` client: forced calls (`required`, a
named function) whose arguments validate against each tool's schema (jsonschema), streamed
deltas that add up to the non-streamed answer, `auto` and `none` (a grammar stands in for a model
that chose to call), the client's `parse` and `stream` helpers, multi-turn messages, refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from live_server import MODEL_NAME, LiveServer, start_server
from pydantic import BaseModel, Field
from resume_streams import cut_after_tokens, events_of, frames_of

from strata.model.loader import LoadedModel
from strata.protocol.resume import RESUMABLE_HEADER, RESUME_PATH

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Rome"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["C", "F"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
    "required": ["zone"], "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def live(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """Room for calls spelled out byte by byte (the tiny model's tokens are bytes)."""
    server = start_server(tiny_model, max_model_len=1024, num_blocks=1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0)


def check_calls(message: Any) -> list[str]:
    """Each call's arguments validate against its tool's schema; the names, in order."""
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [c.function.name for c in message.tool_calls]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI,
                                                         seed: int) -> None:
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=seed, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert check_calls(choice.message) == ["get_time"]


def test_required_picks_among_the_tools_and_parallel_calls_all_validate(
        client: openai.OpenAI) -> None:
    names: set[str] = set()
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", seed=seed,
                                           parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls"
        called = check_calls(r.choices[0].message)
        assert len(called) == 1
        names.update(called)
    assert names == {"get_weather", "get_time"}  # the model chooses
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", seed=4, max_tokens=400,
                                       logit_bias={"10": 30})  # "\n": another call
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and len(message.tool_calls or []) >= 3
    cut = (message.tool_calls or []).pop()  # cut off by max_tokens: a prefix
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.function.arguments)
    check_calls(message)  # the calls finished before the cut


def stream_calls(client: openai.OpenAI, **body: Any) -> tuple[list[tuple[str, str, str]], str]:
    calls: dict[int, list[str]] = {}
    reason = ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                tools=TOOLS, stream=True, **body):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function and d.function.name
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function and d.function.name is None
            calls[d.index][2] += (d.function.arguments or "") if d.function else ""
        reason = choice.finish_reason or reason
    return [(i, n, a) for i, n, a in calls.values()], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_streamed_deltas_add_up_to_the_answer(client: openai.OpenAI, choice: Any) -> None:
    body = {"tool_choice": choice, "seed": 7, "parallel_tool_calls": False}
    streamed, reason = stream_calls(client, **body)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                           **body).choices[0].message
    assert reason == "tool_calls"
    assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments)
                                                for c in whole.tool_calls or []]
    check_calls(whole)


def grammar_of_a_call(text: str) -> dict[str, Any]:
    """A structured_outputs grammar whose only answer is `text` (a model that chose to call)."""
    return {"structured_outputs": {"grammar": f"start: {json.dumps(text)}"}}


CALL_TEXT = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
             '"days": 2, "unit": "C"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_calls_out_of_the_text(client: openai.OpenAI, stream: bool) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS,
                            "extra_body": grammar_of_a_call(CALL_TEXT)}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        assert choice.message.content == "Checking."
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        reason = choice.finish_reason
    else:
        content, parts, reason = "", {}, ""
        for chunk in client.chat.completions.create(stream=True, **body):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                parts.setdefault(d.index, ["", ""])
                parts[d.index][0] += d.function.name or "" if d.function else ""
                parts[d.index][1] += d.function.arguments or "" if d.function else ""
            reason = chunk.choices[0].finish_reason or reason
        assert content == "Checking."
        calls = [(n, a) for n, a in parts.values()]
    assert reason == "tool_calls"
    assert calls == [("get_weather", '{"city": "Rome", "days": 2, "unit": "C"}')]


TWO_CALLS_TEXT = CALL_TEXT + ('\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}'
                             '\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_parallel_tool_calls_answers_with_the_first_call_only(
        client: openai.OpenAI, stream: bool) -> None:
    """A model that wrote two calls: with `parallel_tool_calls: false` the answer holds one."""
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS,
                            "tool_choice": "auto",
                            "extra_body": grammar_of_a_call(TWO_CALLS_TEXT)}
    for parallel, expected in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        if stream:
            calls, reason = stream_calls_of(client, parallel_tool_calls=parallel, **body)
        else:
            choice = client.chat.completions.create(parallel_tool_calls=parallel,
                                                    **body).choices[0]
            assert choice.message.content == "Checking."
            calls, reason = choice.message.tool_calls or [], choice.finish_reason
            check_calls(choice.message)
        assert [c.function.name for c in calls] == expected and reason == "tool_calls"


def stream_calls_of(client: openai.OpenAI, **body: Any) -> tuple[list[Any], str]:
    """The streamed calls as `ChatCompletionMessageToolCall`s, via the client's accumulator."""
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == "Checking."
    return final.message.tool_calls or [], final.finish_reason


def test_none_and_no_tools_leave_the_text_alone(client: openai.OpenAI) -> None:
    for body in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, extra_body=grammar_of_a_call(CALL_TEXT),
            **body).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content == CALL_TEXT
        assert not choice.message.tool_calls


class Weather(BaseModel):
    city: Literal["Oslo", "Rome"]
    days: int = Field(ge=1, le=7)


def test_the_client_parse_and_stream_helpers(client: openai.OpenAI) -> None:
    tool = openai.pydantic_function_tool(Weather, name="weather")
    r = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, tools=[tool],
                                      tool_choice="required", parallel_tool_calls=False, seed=2)
    call = (r.choices[0].message.tool_calls or [])[0]
    assert isinstance(call.function.parsed_arguments, Weather)
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=[tool],
                                        tool_choice="required", parallel_tool_calls=False,
                                        seed=2) as stream:
        final = stream.get_final_completion()
    streamed = (final.choices[0].message.tool_calls or [])[0]
    assert streamed.function.parsed_arguments == call.function.parsed_arguments


def test_a_conversation_with_calls_and_results(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, seed=1, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    call = (first.message.tool_calls or [])[0]
    messages = [*MESSAGES, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "12 C, rain"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS,
                                       max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
     "tool_choice"),
    ("chat/completions", {"tools": TOOLS + TOOLS}, "tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tools": TOOLS, "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, None),
    ("chat/completions", {"functions": [{"name": "f"}]}, None),
    ("completions", {"tools": TOOLS}, None),
])
def test_refusals_name_the_field(live: LiveServer, path: str, body: dict[str, Any],
                                 param: str | None) -> None:
    base: dict[str, Any] = {"model": MODEL_NAME}
    base |= {"messages": MESSAGES} if path.startswith("chat") else {"prompt": "x"}
    r = httpx.post(f"{live.v1}/{path}", json=base | body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    named = param or next(iter(body))
    assert named in error["message"] or named in str(error["param"]), error


def calls_of(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for e in events:
        for c in e["choices"]:
            for d in c["delta"].get("tool_calls") or []:
                entry = calls.setdefault(d["index"], ["", ""])
                entry[0] += d["function"].get("name") or ""
                entry[1] += d["function"].get("arguments") or ""
    return [(n, a) for n, a in calls.values()]


def test_a_forced_call_resumed_mid_stream_is_the_unbroken_call(live: LiveServer) -> None:
    """Mid-stream resume (another instance continues): the constraint is advanced past the sent
    tokens and the parser replays the sent text, so the deltas add up to the same call."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False, "temperature": 0}
    raw = httpx.post(f"{live.v1}/chat/completions", json=body, headers={RESUMABLE_HEADER: "1"},
                     timeout=60).content
    whole = frames_of(raw)
    expected = calls_of(events_of(whole))
    num_tokens = len([t for f in whole for t in f.token_ids])
    assert len(expected) == 1 and num_tokens > 20
    for num_sent in (3, 14, 20, num_tokens - 2):  # in the tag, the name, the arguments, the end
        before, sent = cut_after_tokens(whole, num_sent)
        start = before[0].marks[0]
        resumed = {"path": "/v1/chat/completions", "request": body, "id": start["id"],
                   "created": start["created"], "version": start["version"],
                   "prompt_token_ids": start["prompt"], "output_token_ids": sent}
        rest = frames_of(httpx.post(live.base_url + RESUME_PATH, json=resumed,
                                    timeout=60).content)
        assert calls_of(events_of(before) + events_of(rest)) == expected, num_sent
        assert [t for f in before + rest for t in f.token_ids] == \
            [t for f in whole for t in f.token_ids]
