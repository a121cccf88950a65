"""Reading an OpenAI stream on the client side: JSON events over `strata.protocol.sse` framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import httpx

from strata.protocol.sse import DONE, aparse_events


async def iter_json_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """Yield the JSON object of each event until `[DONE]` or the end of the stream.

    An event carrying an `error` object (a failure after the stream started) raises RuntimeError
    with the server's message; a payload that is not a JSON object raises ValueError.
    """
    async for data in aparse_events(chunks):
        if data == DONE:
            return
        event = json.loads(data)
        if not isinstance(event, dict):
            raise ValueError(f"stream event is not a JSON object: {data[:80]!r}")
        error = event.get("error")
        if isinstance(error, dict):
            raise RuntimeError(str(error.get("message", error)))
        yield event


def chunk_text(event: dict[str, Any]) -> str:
    """The text that a completion or chat-completion chunk carries ('' for none)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


def error_message(resp: httpx.Response) -> str:
    """`HTTP <status>: <message>` from an OpenAI error body (or the start of any other body)."""
    try:
        message = str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = resp.text[:200]
    return f"HTTP {resp.status_code}: {message}"
