"""The instance's side of mid-stream resume, over HTTP on simulated instances: marked streams,
POST /v1/strata/resume continuing a stream cut after any token (text, token ids, usage, envelope
identical to the unbroken stream), a session turn stored once, refusals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from resume_streams import Frame, cut_after_tokens, events_of, frames_of, text_of, usage_of
from sim_instances import SimInstance, start_sim_instance

from strata.protocol.resume import MARK, RESUMABLE_HEADER, RESUME_PATH
from strata.state.sessions import SessionStore, create_session_store

MARKED = {RESUMABLE_HEADER: "1"}


@pytest.fixture(scope="module")
def store() -> SessionStore:
    return create_session_store("memory://")


@pytest.fixture(scope="module")
def instance(store: SessionStore) -> Iterator[SimInstance]:
    served = start_sim_instance(session_store=store)
    yield served
    served.stop()


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=30)


def resume_body(path: str, body: dict[str, Any], frames: list[Frame], sent: list[int],
                **extra: Any) -> dict[str, Any]:
    start = frames[0].marks[0]
    return {"path": path, "request": body, "id": start["id"], "created": start["created"],
            "version": start["version"], "prompt_token_ids": start["prompt"],
            "output_token_ids": sent, **extra}


CHAT = {"model": "sim", "messages": [{"role": "user", "content": "tell me about the sea"}],
        "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0}


def test_a_marked_stream_names_every_token_and_an_unmarked_one_has_no_mark(
        instance: SimInstance) -> None:
    plain = post(instance.url, "/v1/chat/completions", CHAT)
    assert MARK not in plain.content
    marked = frames_of(post(instance.url, "/v1/chat/completions", CHAT, MARKED).content)
    start = marked[0].marks[0]
    assert start["version"] == "sim@default" and start["id"].startswith("chatcmpl-")
    assert (len(start["prompt"]), 24) == usage_of(events_of(marked))[:2]  # type: ignore[index]
    token_ids = [t for f in marked for t in f.token_ids]
    assert len(token_ids) == 24
    assert [m.get("f") for f in marked for m in f.marks if "t" in m][-1] == "length"
    assert text_of(events_of(marked)) == text_of(events_of(frames_of(plain.content)))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_chat_stream_resumed_after_any_token_is_the_unbroken_stream(
        instance: SimInstance, sampling: dict[str, Any]) -> None:
    words = text_of(events_of(frames_of(post(
        instance.url, "/v1/chat/completions", {**CHAT, **sampling}).content))).split()
    stop = f" {words[9]} {words[10]}"  # a stop string of two tokens
    body = {**CHAT, **sampling, "stop": [stop], "logprobs": True}
    whole = frames_of(post(instance.url, "/v1/chat/completions", body, MARKED).content)
    expected = events_of(whole)
    num_tokens = len([t for f in whole for t in f.token_ids])
    assert text_of(expected).endswith(words[8])
    for num_sent in range(1, num_tokens):
        before, sent = cut_after_tokens(whole, num_sent)
        rest = frames_of(post(instance.url, RESUME_PATH,
                              resume_body("/v1/chat/completions", body, before, sent)).content)
        got = events_of(before) + events_of(rest)
        assert text_of(got) == text_of(expected), num_sent
        assert [t for f in before + rest for t in f.token_ids] == \
            [t for f in whole for t in f.token_ids]
        assert usage_of(got) == usage_of(expected)
        assert {(e["id"], e["created"]) for e in got} == {(expected[0]["id"],
                                                           expected[0]["created"])}
        assert sum(1 for e in got for c in e["choices"] if c["delta"].get("role")) == 1
        logprobs = [t for e in got for c in e["choices"] if c.get("logprobs")
                    for t in c["logprobs"]["content"]]
        assert len(logprobs) == num_tokens


def test_a_completion_resumed_keeps_its_echo_once_and_its_text_offsets(
        instance: SimInstance) -> None:
    body = {"model": "sim", "prompt": "the world of", "max_tokens": 12, "stream": True,
            "echo": True, "seed": 3, "temperature": 0.7}  # (echo with logprobs is refused)
    whole = frames_of(post(instance.url, "/v1/completions", body, MARKED).content)
    before, sent = cut_after_tokens(whole, 5)
    rest = frames_of(post(instance.url, RESUME_PATH,
                          resume_body("/v1/completions", body, before, sent)).content)
    assert text_of(events_of(before) + events_of(rest)) == text_of(events_of(whole))
    assert text_of(events_of(whole)).startswith("the world of")
    with_lps = {**body, "echo": False, "logprobs": 1}
    whole = frames_of(post(instance.url, "/v1/completions", with_lps, MARKED).content)
    before, sent = cut_after_tokens(whole, 4)
    rest = frames_of(post(instance.url, RESUME_PATH,
                          resume_body("/v1/completions", with_lps, before, sent)).content)

    def offsets(frames: list[Frame]) -> list[int]:
        return [o for e in events_of(frames) for c in e["choices"] if c.get("logprobs")
                for o in c["logprobs"]["text_offset"]]

    assert offsets(before) + offsets(rest) == offsets(whole)


def session(instance: SimInstance, session_id: str) -> dict[str, Any]:
    return httpx.get(f"{instance.url}/v1/sessions/{session_id}", timeout=10).json()


def turn(instance: SimInstance, session_id: str, content: str) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0}
    answer = post(instance.url, "/v1/chat/completions", body, {"X-Session-Id": session_id})
    assert answer.status_code == 200, answer.text


def test_a_session_turn_resumed_is_stored_once(instance: SimInstance) -> None:
    body = {**CHAT, "temperature": 0, "max_tokens": 10,
            "messages": [{"role": "user", "content": "and the land"}]}
    for session_id in ("s-first", "s-cut", "s-moved"):
        turn(instance, session_id, "tell me about the sea")  # the same first turn
    turn(instance, "s-moved", "something else")  # this one's history moved on
    first = post(instance.url, "/v1/chat/completions", body,
                 {**MARKED, "X-Session-Id": "s-first"})
    assert first.headers["x-session-revision"] == "2"
    frames = frames_of(first.content)
    stored = session(instance, "s-first")["messages"]
    # s-cut's second turn broke after 3 tokens, never stored: the resume stores it whole
    before, sent = cut_after_tokens(frames, 3)
    cut = {**MARKED, "X-Session-Id": "s-cut"}
    rest = frames_of(post(instance.url, RESUME_PATH, resume_body(
        "/v1/chat/completions", body, before, sent, session_revision=2), cut).content)
    assert not any("error" in e for e in events_of(rest))
    assert text_of(events_of(before) + events_of(rest)) == text_of(events_of(frames))
    assert session(instance, "s-cut")["messages"] == stored
    # the resumed stream died before [DONE] after storing; resumed again after its last
    # token, the turn is found stored: no error, no second copy
    finish = {"reason": "length", "stop_reason": None}
    all_sent = [t for f in frames for t in f.token_ids]
    again = frames_of(post(instance.url, RESUME_PATH, resume_body(
        "/v1/chat/completions", body, frames, all_sent, finish=finish, session_revision=2),
        cut).content)
    assert [f.data for f in again][-1] == ["[DONE]"]
    assert not any("error" in e for e in events_of(again))
    assert usage_of(events_of(again)) == usage_of(events_of(frames))
    assert session(instance, "s-cut")["revision"] == 2
    assert session(instance, "s-cut")["messages"] == stored
    # another turn was stored meanwhile: the resumed answer is sent but not stored
    moved = frames_of(post(instance.url, RESUME_PATH, resume_body(
        "/v1/chat/completions", body, before, sent, session_revision=2),
        {**MARKED, "X-Session-Id": "s-moved"}).content)
    assert [e["error"]["type"] for e in events_of(moved) if "error" in e] == ["session_conflict"]
    assert session(instance, "s-moved")["revision"] == 2


def test_resume_is_refused_for_another_version_or_several_choices(
        instance: SimInstance) -> None:
    whole = frames_of(post(instance.url, "/v1/chat/completions", CHAT, MARKED).content)
    before, sent = cut_after_tokens(whole, 2)
    other = resume_body("/v1/chat/completions", CHAT, before, sent, version="sim@v2")
    assert post(instance.url, RESUME_PATH, other).status_code == 404
    several = resume_body("/v1/chat/completions", {**CHAT, "n": 2}, before, sent)
    assert post(instance.url, RESUME_PATH, several).status_code == 400
    unknown = {**resume_body("/v1/chat/completions", CHAT, before, sent), "extra": 1}
    assert post(instance.url, RESUME_PATH, unknown).status_code == 400
