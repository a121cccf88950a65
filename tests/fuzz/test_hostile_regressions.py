"""Each finding of the fuzzers, pinned: the body that broke something, and what it gets now
(from the instance and the gateway alike, over real sockets)."""

from __future__ import annotations

import httpx
import pytest
from harness.fuzz import is_error_body
from sim_stack import MODEL, Targets

from strata.errors import InvalidRequestError
from strata.protocol.json_body import MAX_JSON_DEPTH, check_depth, parse_json_object

CHAT = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'


def chat_with(content: bytes) -> bytes:
    return CHAT % (MODEL.encode(), content)


HOSTILE = {  # name -> (body, a word of the 400's message)
    "nested_5000_arrays": (chat_with(b"[" * 5000 + b"]" * 5000), "levels deep"),
    "nested_3000_objects": (b'{"a":' * 3000 + b"1" + b"}" * 3000, "levels deep"),
    "nested_just_too_deep": (chat_with(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH),
                             "levels deep"),
    "truncated": (chat_with(b'"hi"')[:-7], "not valid JSON"),
    "nan": (b'{"prompt": "a", "temperature": NaN}', "NaN"),
    "infinity_literal": (b'{"prompt": "a", "temperature": -Infinity}', "Infinity"),
    "float_overflow": (b'{"prompt": "a", "temperature": 1e999}', "out of range"),
    "5000_digit_int": (b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
                       "not valid JSON"),
    "lone_surrogate": (chat_with(b'"\\ud800"'), "surrogate"),
    "invalid_utf8": (chat_with(b'"\xff\xfe"'), "not valid JSON"),
    "seed_2_63": (b'{"prompt": "a", "max_tokens": 2, "seed": 9223372036854775808}', "seed"),
    "seed_below_int64": (b'{"prompt": "a", "max_tokens": 2, "seed": -9223372036854775809}',
                         "seed"),
    "not_an_object": (b"[1, 2]", "JSON object"),
}


@pytest.mark.parametrize("target", ["instance", "gateway"])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_body_gets_a_400_with_an_openai_error_body(targets: Targets, target: str,
                                                           name: str) -> None:
    body, word = HOSTILE[name]
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    response = httpx.post(targets.urls[target] + path, content=body, timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert is_error_body(response.content)
    assert word in response.json()["error"]["message"]


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_the_instance_lives_after_every_hostile_body(targets: Targets, target: str) -> None:
    for body, _ in HOSTILE.values():
        httpx.post(targets.urls[target] + "/v1/completions", content=body, timeout=10)
    answer = httpx.post(targets.urls[target] + "/v1/completions", timeout=10,
                        json={"model": MODEL, "prompt": "a", "max_tokens": 2,
                              "seed": 9223372036854775807, "n": 2})  # seed + 1 wraps: valid
    assert answer.status_code == 200, answer.text
    assert [c["finish_reason"] for c in answer.json()["choices"]] == ["length", "length"]


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_unknown_paths_and_methods_get_openai_error_bodies(targets: Targets,
                                                            target: str) -> None:
    missing = httpx.get(targets.urls[target] + "/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and is_error_body(missing.content)
    wrong = httpx.get(targets.urls[target] + "/v1/chat/completions", timeout=10)
    assert wrong.status_code == 405 and is_error_body(wrong.content)
    assert "POST" in wrong.headers["allow"]


def test_the_depth_scan_skips_brackets_inside_strings_and_escapes() -> None:
    check_depth(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "b": "\\"["}',
                max_depth=2)
    with pytest.raises(InvalidRequestError, match="more than 2 levels"):
        check_depth(b'{"a": "\\\\", "b": [[1]]}', max_depth=2)
    assert parse_json_object(b'{"e": "\\ud83d\\ude00"}') == {"e": "\U0001f600"}  # paired: fine


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_a_session_id_with_control_characters_is_a_404_not_a_500(targets: Targets,
                                                                 target: str) -> None:
    """Found by Schemathesis: the gateway forwarded the decoded path, an invalid URL."""
    odd = "%3FH%60%3C%24j%C3%90%16%C3%AE%F1%A2%B0%A8"
    answer = httpx.get(f"{targets.urls[target]}/v1/sessions/{odd}", timeout=10)
    assert answer.status_code == 404, answer.text
    assert is_error_body(answer.content)
