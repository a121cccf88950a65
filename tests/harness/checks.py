"""Whether one OpenAI completion answer is a whole success, for load that counts failures.

A success is a 200 whose body (one JSON object, or SSE events ending in one `[DONE]`) carries no
error and ends every choice with an expected `finish_reason`. A stream cut by an instance
failure after it started is a 200 that ends with an error event and then `[DONE]`: a failure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from strata.protocol.sse import DONE, parse_events

FINISHED = frozenset({"stop", "length"})


def completion_failure(status: int, body: bytes, *, is_stream: bool,
                       finish_reasons: Iterable[str] = FINISHED) -> str | None:
    """Why this answer is not a whole success, or None when it is."""
    if status != 200:
        return f"HTTP {status}: {body[:200]!r}"
    try:
        if is_stream:
            events, why = _stream_events(body)
            if why:
                return why
        else:
            events = [json.loads(body)]
    except ValueError as exc:
        return f"not JSON: {exc}"
    return _finish_failure(events, frozenset(finish_reasons))


def _stream_events(body: bytes) -> tuple[list[dict[str, Any]], str | None]:
    payloads = list(parse_events([body]))
    if not payloads or payloads[-1] != DONE:
        return [], "the stream did not end with [DONE]"
    if DONE in payloads[:-1]:
        return [], "[DONE] before the end of the stream"
    return [json.loads(p) for p in payloads[:-1]], None


def _finish_failure(events: list[dict[str, Any]], expected: frozenset[str]) -> str | None:
    reasons: dict[int, str] = {}
    for event in events:
        if not isinstance(event, dict):
            return f"an event is not a JSON object: {event!r:.80}"
        if event.get("error") is not None:
            error = event["error"]
            return f"error event: {error.get('message') if isinstance(error, dict) else error}"
        for choice in event.get("choices") or []:
            if choice.get("finish_reason") is not None:
                reasons[int(choice.get("index", 0))] = str(choice["finish_reason"])
    if not reasons:
        return "no choice finished (no finish_reason)"
    unexpected = sorted({r for r in reasons.values() if r not in expected})
    return f"finish_reason {', '.join(unexpected)}" if unexpected else None


__all__ = ["FINISHED", "completion_failure"]
