"""Sessions over real sockets with the `openai` client: the instance keeps the history."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import MODEL_NAME, GatedExecutor, LiveServer, start_server, wait_until

from strata.model.loader import LoadedModel
from strata.protocol.sse import parse_json_events

KEY_A, KEY_B = "key-alice", "key-bob"
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    live = start_server(tiny_model, session_store_url="memory://", api_keys=(KEY_A, KEY_B))
    yield live
    live.stop()


def client(server: LiveServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def new_id() -> str:
    return f"chat-{uuid.uuid4().hex[:8]}"


def turn(server: LiveServer, session_id: str, text: str, *, key: str = KEY_A,
         **extra: Any) -> tuple[Any, httpx.Headers]:
    """One session turn sending only the new user message; (completion, response headers)."""
    params = {**GREEDY, **extra}
    raw = client(server, key).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": text}],
        extra_headers={"X-Session-Id": session_id}, **params)
    return raw.parse(), raw.headers


def session(server: LiveServer, session_id: str, key: str = KEY_A) -> httpx.Response:
    return httpx.get(f"{server.v1}/sessions/{session_id}",
                     headers={"Authorization": f"Bearer {key}"})


def test_three_turns_see_the_whole_history_as_if_sent_in_full(server: LiveServer) -> None:
    sid, history = new_id(), []
    prompt_tokens = []
    for i, text in enumerate(["hello there", "what next?", "and then"]):
        if i == 1:  # the body's session_id works like the header
            raw = client(server).chat.completions.with_raw_response.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": text}],
                **{**GREEDY, "extra_body": {"ignore_eos": True, "session_id": sid}})
            out, headers = raw.parse(), raw.headers
        else:
            out, headers = turn(server, sid, text)
        history.append({"role": "user", "content": text})
        full = client(server).chat.completions.create(model=MODEL_NAME, messages=history,
                                                      **GREEDY)
        assert out.usage.prompt_tokens == full.usage.prompt_tokens
        assert out.choices[0].message.content == full.choices[0].message.content
        assert (headers["x-session-id"], headers["x-session-revision"]) == (sid, str(i + 1))
        assert out.model_extra["strata"] == {"session_id": sid, "session_revision": i + 1,
                                             "session_stored": True,
                                             "session_truncated_turns": 0}
        history.append({"role": "assistant", "content": out.choices[0].message.content})
        prompt_tokens.append(out.usage.prompt_tokens)
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]
    body = session(server, sid).json()
    assert body["messages"] == history
    assert (body["id"], body["revision"], body["model"], body["version"]) == \
        (sid, 3, MODEL_NAME, "default")


def test_get_list_and_delete(server: LiveServer) -> None:
    sid = new_id()
    turn(server, sid, "remember me")
    auth = {"Authorization": f"Bearer {KEY_A}"}
    listed = httpx.get(f"{server.v1}/sessions", headers=auth).json()["data"]
    assert [(s["revision"], s["num_messages"]) for s in listed if s["id"] == sid] == [(1, 2)]
    assert httpx.delete(f"{server.v1}/sessions/{sid}", headers=auth).status_code == 204
    assert session(server, sid).status_code == 404
    again = httpx.delete(f"{server.v1}/sessions/{sid}", headers=auth)
    assert again.status_code == 404 and again.json()["error"]["type"] == "not_found_error"
    out, headers = turn(server, sid, "new start")  # a deleted id starts over
    assert headers["x-session-revision"] == "1" and out.usage.prompt_tokens > 0


def test_another_api_key_gets_404_and_its_own_session(server: LiveServer) -> None:
    sid = new_id()
    turn(server, sid, "alice speaks")
    assert session(server, sid, KEY_B).status_code == 404
    bob = {"Authorization": f"Bearer {KEY_B}"}
    assert httpx.delete(f"{server.v1}/sessions/{sid}", headers=bob).status_code == 404
    assert sid not in [s["id"] for s in httpx.get(f"{server.v1}/sessions", headers=bob)
                       .json()["data"]]
    _, headers = turn(server, sid, "bob speaks", key=KEY_B)
    assert headers["x-session-revision"] == "1"  # Bob's own session, not Alice's history
    alice = session(server, sid).json()
    assert [m["content"] for m in alice["messages"]][0] == "alice speaks"
    assert alice["revision"] == 1
    assert session(server, sid, KEY_B).json()["messages"][0]["content"] == "bob speaks"


def test_a_refused_turn_stores_nothing(server: LiveServer) -> None:
    sid = new_id()
    turn(server, sid, "first")
    with pytest.raises(openai.BadRequestError) as err:
        turn(server, sid, "too long an answer", max_tokens=1000)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        turn(server, sid, "two answers?", n=2)
    assert session(server, sid).json()["revision"] == 1


def test_history_beyond_the_context_drops_the_oldest_turns(server: LiveServer) -> None:
    sid = new_id()
    system = {"role": "system", "content": "be brief"}
    long_texts = ["a" * 30, "b" * 30, "c" * 30]
    raw = client(server).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=[system, {"role": "user", "content": long_texts[0]}],
        extra_headers={"X-Session-Id": sid}, **GREEDY)
    answers = [raw.parse().choices[0].message.content]
    truncated = []
    for text in long_texts[1:]:
        out, headers = turn(server, sid, text)
        truncated.append(int(headers["x-strata-session-truncated"]))
        answers.append(out.choices[0].message.content)
    assert truncated == [0, 1]
    assert out.model_extra["strata"]["session_truncated_turns"] == 1
    kept = [system, {"role": "user", "content": long_texts[1]},
            {"role": "assistant", "content": answers[1]},
            {"role": "user", "content": long_texts[2]}]
    explicit = client(server).chat.completions.create(model=MODEL_NAME, messages=kept, **GREEDY)
    assert out.usage.prompt_tokens == explicit.usage.prompt_tokens
    assert out.choices[0].message.content == explicit.choices[0].message.content
    assert len(session(server, sid).json()["messages"]) == 7  # the store keeps everything
    with pytest.raises(openai.BadRequestError, match="even without the session's history"):
        turn(server, sid, "z" * 200)


def test_a_streamed_turn_is_stored_after_its_last_token(server: LiveServer) -> None:
    sid = new_id()
    turn(server, sid, "before")
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "stream it"}],
            "stream": True, "temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    with httpx.stream("POST", f"{server.v1}/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY_A}", "X-Session-Id": sid}) as r:
        assert (r.headers["x-session-id"], r.headers["x-session-revision"]) == (sid, "2")
        events = list(parse_json_events(r.iter_bytes()))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    stored = session(server, sid).json()
    assert stored["revision"] == 2
    assert stored["messages"][-2:] == [{"role": "user", "content": "stream it"},
                                       {"role": "assistant", "content": text}]


def _gated(tiny_model: LoadedModel, url: str) -> tuple[LiveServer, GatedExecutor]:
    holder: list[GatedExecutor] = []

    def wrap(inner: object) -> GatedExecutor:
        holder.append(GatedExecutor(inner))
        return holder[0]

    return start_server(tiny_model, wrap=wrap, session_store_url=url), holder[0]


def test_concurrent_turns_on_one_instance_are_serialised(tiny_model: LoadedModel) -> None:
    live, gate = _gated(tiny_model, "memory://")
    try:
        gate.hold()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(turn, live, "s", "first")
            assert wait_until(lambda: gate.num_blocked >= 1)  # turn 1 is generating
            second = pool.submit(turn, live, "s", "second")
            gate.open()
            (out1, h1), (out2, h2) = first.result(), second.result()
        assert (h1["x-session-revision"], h2["x-session-revision"]) == ("1", "2")
        assert out2.usage.prompt_tokens > out1.usage.prompt_tokens  # it saw turn 1's answer
        stored = httpx.get(f"{live.v1}/sessions/s").json()
        assert [m["content"] for m in stored["messages"]] == [
            "first", out1.choices[0].message.content, "second", out2.choices[0].message.content]
    finally:
        gate.open()
        live.stop()


def test_a_turn_overtaken_on_another_instance_gets_409(tiny_model: LoadedModel,
                                                       tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sessions.db'}"
    slow, gate = _gated(tiny_model, url)
    fast = start_server(tiny_model, session_store_url=url)
    try:
        turn(fast, "s", "opening")
        gate.hold()
        with ThreadPoolExecutor(1) as pool:
            overtaken = pool.submit(turn, slow, "s", "on the slow instance")
            assert wait_until(lambda: gate.num_blocked >= 1)  # it read revision 1
            out, headers = turn(fast, "s", "on the fast instance")
            gate.open()
            with pytest.raises(openai.APIStatusError) as err:
                overtaken.result()
        assert err.value.status_code == 409
        assert err.value.body["type"] == "session_conflict"  # type: ignore[index]
        stored = httpx.get(f"{fast.v1}/sessions/s").json()
        assert stored["revision"] == 2 == int(headers["x-session-revision"])
        assert [m["content"] for m in stored["messages"]][2:] == [
            "on the fast instance", out.choices[0].message.content]
    finally:
        gate.open()
        slow.stop()
        fast.stop()


def test_a_server_without_a_store_says_how_to_turn_sessions_on(live: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(f"{live.v1}/chat/completions", json=body, headers={"X-Session-Id": "s"})
    assert r.status_code == 400 and "--session-store" in r.json()["error"]["message"]
    assert httpx.get(f"{live.v1}/sessions").status_code == 400
