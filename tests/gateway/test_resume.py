"""Mid-stream resume in the gateway over scripted upstreams (httpx.MockTransport): which streams
are marked, what the client receives (the frames without marks, one stream), the resume request
the next instance gets, and every way a resume is refused or runs out."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
from gateway_fakes import FakeClock, FixedSource, Upstreams, sse_answer, view

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig, ResumeConfig, RetryConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.wiring import Gateway
from strata.protocol.resume import RESUMABLE_HEADER, RESUME_PATH, start_mark, tokens_mark
from strata.protocol.sse import DONE_FRAME, encode_event, parse_events

CONFIG = GatewayConfig(policy="round_robin", retry=RetryConfig(max_retries=2, backoff_base_s=0.0))
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "temperature": 0}
START = start_mark(id="chatcmpl-1", created=7, version="m@default", prompt_token_ids=[1, 2, 3])


def delta(text: str | None, finish: str | None = None) -> bytes:
    return encode_event({"id": "chatcmpl-1", "created": 7, "choices": [
        {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}]})


ROLE = encode_event({"id": "chatcmpl-1", "created": 7,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
FIRST = [START + ROLE, tokens_mark([10]) + delta(" sea"), tokens_mark([11]) + b"\n"]
REST = [tokens_mark([12]) + delta(" and sky"), tokens_mark([13], "length") + delta("", "length"),
        DONE_FRAME]


class Scripted:
    """Upstream handlers that record the requests they got."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def breaks(self, *frames: bytes) -> Any:
        def answer(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            return sse_answer(*frames, breaks=True)
        return answer

    def answers(self, *frames: bytes, status: int = 200) -> Any:
        def answer(request: httpx.Request) -> httpx.Response:
            self.requests.append(request)
            if status != 200:
                return httpx.Response(status, json={"error": {"message": "no"}})
            return sse_answer(*frames)
        return answer

    def resume_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == RESUME_PATH]


def stream(upstreams: Upstreams, views: list[InstanceView], body: dict[str, Any] = BODY,
           config: GatewayConfig = CONFIG,
           headers: dict[str, str] | None = None) -> tuple[httpx.Response, Gateway]:
    app = create_gateway_app(config, FixedSource(*views), transport=upstreams.transport(),
                             clock=FakeClock(), run_background=False)

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            return await client.post("/v1/chat/completions", json=body, headers=headers or {})

    return asyncio.run(run()), app.state.gateway


def metric(gateway: Gateway, name: str, **labels: str) -> float:
    return gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_broken_stream_goes_on_on_another_instance_as_one_stream() -> None:
    script = Scripted()
    upstreams = Upstreams(a=script.breaks(*FIRST), b=script.answers(*REST))
    response, gateway = stream(upstreams, [view("a"), view("b")])
    assert response.content == ROLE + delta(" sea") + delta(" and sky") + \
        delta("", "length") + DONE_FRAME
    assert response.headers["x-strata-instance"] == "a"
    assert upstreams.calls == [("a", "/v1/chat/completions"), ("b", RESUME_PATH)]
    assert [r.headers.get(RESUMABLE_HEADER) for r in script.requests] == ["1", "1"]
    assert script.resume_bodies() == [{
        "path": "/v1/chat/completions", "request": BODY, "id": "chatcmpl-1", "created": 7,
        "version": "m@default", "prompt_token_ids": [1, 2, 3], "output_token_ids": [10, 11],
        "finish": None, "session_revision": None}]
    assert metric(gateway, "strata:gateway_stream_resumes_total", outcome="resumed") == 1
    assert metric(gateway, "strata:gateway_broken_streams_total") == 1
    a, b = (gateway.source.instances.get(i) for i in "ab")
    assert a is not None and b is not None
    assert (a.consecutive_failures, a.num_in_flight, b.num_in_flight) == (1, 0, 0)


def test_a_stream_broken_after_its_last_token_is_finished_by_the_next_instance() -> None:
    script = Scripted()
    done = [*FIRST, *REST[:2]]
    upstreams = Upstreams(a=script.breaks(*done), b=script.answers(DONE_FRAME))
    response, _ = stream(upstreams, [view("a"), view("b")],
                         headers={"X-Session-Id": "s1"})
    assert list(parse_events([response.content]))[-1] == "[DONE]"
    body = script.resume_bodies()[0]
    assert body["output_token_ids"] == [10, 11, 12, 13]
    assert body["finish"] == {"reason": "length", "stop_reason": None}
    assert [r.headers.get("x-session-id") for r in script.requests] == ["s1", "s1"]


def test_a_stream_its_engine_failed_is_resumed_and_the_failure_never_reaches_the_client(
        ) -> None:
    script = Scripted()
    failed = [*FIRST, tokens_mark([], "error") + delta("", "error"),
              encode_event({"error": {"message": "the engine died", "type": "x"}}), DONE_FRAME]
    upstreams = Upstreams(a=script.answers(*failed), b=script.answers(*REST))
    response, gateway = stream(upstreams, [view("a"), view("b")])
    assert response.content == ROLE + delta(" sea") + delta(" and sky") + \
        delta("", "length") + DONE_FRAME
    assert script.resume_bodies()[0]["output_token_ids"] == [10, 11]
    assert script.resume_bodies()[0]["finish"] is None
    assert metric(gateway, "strata:gateway_stream_resumes_total", outcome="resumed") == 1


def test_the_session_revision_the_first_answer_announced_goes_with_the_resume() -> None:
    script = Scripted()

    def first(request: httpx.Request) -> httpx.Response:
        answer = script.breaks(*FIRST)(request)
        answer.headers["x-session-revision"] = "4"
        return answer

    stream(Upstreams(a=first, b=script.answers(*REST)), [view("a"), view("b")])
    assert script.resume_bodies()[0]["session_revision"] == 4


def errors_of(response: httpx.Response) -> list[str]:
    events = list(parse_events([response.content]))
    assert events[-1] == "[DONE]"
    return [json.loads(e)["error"]["message"] for e in events[:-1] if "error" in json.loads(e)]


def test_an_unmarked_stream_ends_with_an_error_event() -> None:
    script = Scripted()
    unmarked = [ROLE, delta(" sea")]  # n > 1: the instance marks nothing
    upstreams = Upstreams(a=script.breaks(*unmarked), b=script.answers(*REST))
    response, gateway = stream(upstreams, [view("a"), view("b")])
    assert errors_of(response) == ["the stream broke: instance a failed: RemoteProtocolError: "
                                   "peer closed connection without sending complete body"]
    assert upstreams.calls == [("a", "/v1/chat/completions")]
    assert metric(gateway, "strata:gateway_stream_resumes_total", outcome="impossible") == 1


def in_turn(*handlers: Any) -> Any:
    """One handler for several hosts: the n-th call gets the n-th answer."""
    answers = iter(handlers)
    return lambda request: next(answers)(request)


def test_resumes_are_bounded_and_each_goes_to_an_instance_the_stream_has_not_tried() -> None:
    script = Scripted()
    again = [tokens_mark([12]) + delta(" and sky")]
    resumes = in_turn(script.breaks(*again), script.breaks(*again), script.answers(*REST[1:]))
    upstreams = Upstreams(a=script.breaks(*FIRST), b=resumes, c=resumes)
    one = dataclasses.replace(CONFIG, resume=ResumeConfig(max_resumes=1))
    response, _ = stream(upstreams, [view("a"), view("b"), view("c")], config=one)
    assert len(errors_of(response)) == 1 and b" and sky" in response.content
    assert [h for h, _ in upstreams.calls][0] == "a" and len(upstreams.calls) == 2
    response, _ = stream(upstreams, [view("a"), view("b"), view("c")])
    assert errors_of(response) == []
    assert response.content.count(b" and sky") == 1
    hosts = [h for h, _ in upstreams.calls[2:]]
    assert hosts[0] == "a" and sorted(hosts[1:]) == ["b", "c"]
    assert [b["output_token_ids"] for b in script.resume_bodies()] == [[10, 11], [10, 11],
                                                                      [10, 11, 12]]


def test_a_failed_resume_attempt_is_retried_elsewhere_and_a_refusal_is_not(
        caplog: pytest.LogCaptureFixture) -> None:
    script = Scripted()
    others = in_turn(script.answers(status=503), script.answers(*REST))
    upstreams = Upstreams(a=script.breaks(*FIRST), b=others, c=others)
    response, _ = stream(upstreams, [view("a"), view("b"), view("c")])
    assert errors_of(response) == []
    assert [p for _, p in upstreams.calls] == ["/v1/chat/completions", RESUME_PATH, RESUME_PATH]
    assert len({h for h, _ in upstreams.calls}) == 3
    refused = script.answers(status=404)
    upstreams = Upstreams(a=script.breaks(*FIRST), b=refused, c=refused)
    response, gateway = stream(upstreams, [view("a"), view("b"), view("c")])
    assert [p for _, p in upstreams.calls] == ["/v1/chat/completions", RESUME_PATH]
    refuser = upstreams.calls[1][0]
    assert errors_of(response) == [
        "the stream broke: instance a failed: RemoteProtocolError: peer closed connection "
        f"without sending complete body; its resume on instance {refuser} was refused: 404 no"]
    assert [r.getMessage() for r in caplog.records if r.name == "strata.gateway"] == [
        f"instance {refuser} refused to resume a stream of /v1/chat/completions: 404 no"]
    assert metric(gateway, "strata:gateway_stream_resumes_total", outcome="failed") == 1


def test_only_streams_are_marked_and_a_client_cannot_ask_for_marks_when_resuming_is_off(
        ) -> None:
    script = Scripted()
    upstreams = Upstreams(a=script.answers(ROLE, DONE_FRAME))
    stream(upstreams, [view("a")], body={**BODY, "stream": False})
    off = dataclasses.replace(CONFIG, resume=ResumeConfig(max_resumes=0))
    stream(upstreams, [view("a")], config=off, headers={RESUMABLE_HEADER: "1"})
    assert [r.headers.get(RESUMABLE_HEADER) for r in script.requests] == [None, None]


@pytest.mark.parametrize("frames,expected", [
    (b": strata {}\ndata: x\n\n: strata {}\n\n", b"data: x\n\n"),
    (b"data: x\n\ndata: y\n\n", b"data: x\n\ndata: y\n\n"),
    (b": strata {}\ndata: x\n\ndata: partial", b"data: x\n\ndata: partial"),
])
def test_marks_are_taken_out_of_the_frames(frames: bytes, expected: bytes) -> None:
    from strata.gateway.upstream.resume import StreamRecord

    record = StreamRecord(request=None)  # type: ignore[arg-type]
    assert record.take(frames) == expected
    assert len(record.marks) == frames.count(b": strata")


@pytest.mark.parametrize("status,body,expected", [
    (400, b'{"error": {"message": "token ids must be in [0, 9)"}}',
     "400 token ids must be in [0, 9)"),
    (404, b"Not Found", "404 Not Found"),
    (400, b'{"detail": "x"}', '400 {"detail": "x"}'),
    (409, b"", "409"),
])
def test_a_refusal_is_told_by_its_status_and_message(status: int, body: bytes,
                                                     expected: str) -> None:
    from strata.gateway.upstream.resume import refusal_of

    assert asyncio.run(refusal_of(httpx.Response(status, content=body))) == expected
