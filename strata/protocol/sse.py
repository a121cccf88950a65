"""Server-sent events as OpenAI uses them: `data: <json>\\n\\n` frames ending in `data: [DONE]`.

Framing is used by the instance server; parsing by the gateway and tests, which may receive a
stream in arbitrary byte chunks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

from pydantic import BaseModel

DONE = "[DONE]"
DONE_FRAME = b"data: [DONE]\n\n"


def encode_event(payload: BaseModel | dict[str, Any] | str) -> bytes:
    """One SSE frame. Models are dumped as JSON (None fields kept: OpenAI sends nulls)."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = json.dumps(payload, separators=(",", ":"))
    else:
        data = payload
    return f"data: {data}\n\n".encode()


class SSEParser:
    """Incremental parser: feed bytes, get the `data` payloads of complete events.

    Lines other than `data:` (comments, `event:`, `id:`) are ignored; multi-line data is joined
    with newlines as the SSE spec says.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._decoder_tail = b""

    def feed(self, chunk: bytes) -> list[str]:
        """Returns the data of each event completed by `chunk`."""
        raw = self._decoder_tail + chunk
        try:
            text = raw.decode()
            self._decoder_tail = b""
        except UnicodeDecodeError as exc:  # a chunk may end inside a UTF-8 character
            text = raw[: exc.start].decode()
            self._decoder_tail = raw[exc.start :]
        self._buffer += text.replace("\r\n", "\n")
        events: list[str] = []
        while "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def parse_events(chunks: Iterable[bytes]) -> Iterator[str]:
    """The data payloads of a whole byte stream, `[DONE]` included."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)


async def aparse_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Async version of `parse_events`."""
    parser = SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event


def parse_json_events(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """Decoded JSON payloads up to (not including) `[DONE]`."""
    for data in parse_events(chunks):
        if data == DONE:
            return
        yield json.loads(data)


__all__ = [
    "DONE",
    "DONE_FRAME",
    "SSEParser",
    "aparse_events",
    "encode_event",
    "parse_events",
    "parse_json_events",
]
