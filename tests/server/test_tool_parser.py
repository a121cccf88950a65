"""The Hermes tool-call parser: streamed in any chunking it says what the whole text says; content
outside the tags is kept (a partial tag held back); arguments stream as a prefix of the final
string; a body that is not a call stays content."""

from __future__ import annotations

import json
import random

import pytest

from strata.server.tool_parser import CallDelta, ToolCallParser, parse_all

TWO_CALLS = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
             '"days": {"n": 2}}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}'
             '\n</tool_call>')


def streamed(text: str, cuts: list[int]) -> tuple[str, list[CallDelta]]:
    parser, content, deltas = ToolCallParser(), "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        parsed = parser.feed(text[a:b])
        content += parsed.content
        deltas += parsed.calls
    last = parser.finish()
    return content + last.content, deltas + last.calls


def merged(deltas: list[CallDelta]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        entry = calls.setdefault(d.index, ["", ""])
        assert (d.id is not None) == (entry == ["", ""])  # the id comes once, first
        entry[0] += d.name or ""
        entry[1] += d.arguments
    return [(name, args) for name, args in calls.values()]


def test_whole_text() -> None:
    content, calls = parse_all(TWO_CALLS)
    assert content == "Let me check. \n"
    assert [(n, json.loads(a)) for _, n, a in calls] == [
        ("get_weather", {"city": "Oslo", "days": {"n": 2}}), ("time", {})]
    assert all(i.startswith("call_") for i, _, _ in calls) and calls[0][0] != calls[1][0]
    assert calls[0][2] == '{"city": "Oslo", "days": {"n": 2}}'  # the model's own text


@pytest.mark.parametrize("seed", range(30))
def test_any_chunking_gives_the_same_calls(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 40)))
    content, deltas = streamed(TWO_CALLS, cuts)
    assert content == "Let me check. \n"
    assert merged(deltas) == [("get_weather", '{"city": "Oslo", "days": {"n": 2}}'),
                              ("time", "{}")]


def test_one_character_at_a_time_streams_arguments_before_the_close() -> None:
    parser = ToolCallParser()
    sent = ""
    prefix = TWO_CALLS[:TWO_CALLS.index('"days"')]
    for ch in prefix:
        for d in parser.feed(ch).calls:
            sent += d.arguments
    assert sent == '{"city": "Oslo",'  # on the way before the call closes (not the space)


def test_text_without_calls_and_partial_tags() -> None:
    parser = ToolCallParser()
    assert parser.feed("a <tool").content == "a "  # could be a tag: held back
    assert parser.feed("box> b").content == "<toolbox> b"
    assert parser.finish().content == ""
    assert parse_all("plain < text <tool_ca") == ("plain < text <tool_ca", [])


def test_a_body_that_is_no_call_stays_content() -> None:
    text = "x<tool_call>not json</tool_call>y<tool_call>[1]</tool_call>"
    assert parse_all(text) == (text, [])


def test_other_layouts_come_whole_and_string_arguments_stay_strings() -> None:
    text = ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
            '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>')
    content, calls = parse_all(text)
    assert content == "" and [(n, a) for _, n, a in calls] == [("f", '{"a": 1}'),
                                                                ("g", '{"b": 2}')]


def test_an_unclosed_call_at_the_end_is_closed_when_its_json_is_whole() -> None:
    content, calls = parse_all('<tool_call>\n{"name": "f", "arguments": {"a": [1]}}')
    assert content == "" and [(n, a) for _, n, a in calls] == [("f", '{"a": [1]}')]
