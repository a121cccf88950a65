"""What counts as a whole success when load counts failures: exact verdicts on crafted answers."""

from __future__ import annotations

import json

from harness.checks import completion_failure


def frame(payload: object) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def chunk(text: str, reason: str | None = None) -> bytes:
    return frame({"choices": [{"index": 0, "text": text, "finish_reason": reason}]})


WHOLE = chunk("a") + chunk("b", "length") + frame("[DONE]")
CUT = chunk("a") + frame({"error": {"message": "the instance failed mid-stream"}}) + frame(
    "[DONE]")


def test_a_whole_stream_passes_and_a_cut_one_fails_though_both_are_200_with_done() -> None:
    assert completion_failure(200, WHOLE, is_stream=True) is None
    assert completion_failure(200, CUT, is_stream=True) == \
        "error event: the instance failed mid-stream"
    assert completion_failure(200, chunk("a"), is_stream=True) == \
        "the stream did not end with [DONE]"
    assert completion_failure(200, chunk("a") + frame("[DONE]"), is_stream=True) == \
        "no choice finished (no finish_reason)"
    assert completion_failure(200, WHOLE, is_stream=True, finish_reasons={"stop"}) == \
        "finish_reason length"
    assert completion_failure(200, frame("[DONE]") + WHOLE, is_stream=True) == \
        "[DONE] before the end of the stream"


def test_a_plain_answer_is_judged_by_its_status_error_and_finish_reasons() -> None:
    ok = {"choices": [{"index": 0, "text": "ab", "finish_reason": "length"},
                      {"index": 1, "text": "c", "finish_reason": "stop"}]}
    assert completion_failure(200, json.dumps(ok).encode(), is_stream=False) is None
    aborted = {"choices": [{"index": 0, "text": "a", "finish_reason": "abort"}]}
    assert completion_failure(200, json.dumps(aborted).encode(), is_stream=False) == \
        "finish_reason abort"
    assert completion_failure(503, b'{"error": {}}', is_stream=False) == \
        "HTTP 503: b'{\"error\": {}}'"
    assert completion_failure(200, b"<html>", is_stream=False).startswith("not JSON")
