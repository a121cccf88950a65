"""The usage of one answer, as the instance reported it: a JSON body's `usage`, or a stream's
last usage chunk (sent when the request set `stream_options.include_usage`). A stream without one
counts its request (and its error) but no tokens."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from strata.state.usage import Counts

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_ERROR = re.compile(rb'^data: \{\s*"error"\s*:', re.MULTILINE)


def counts_of_usage(usage: object) -> Counts:
    """One request's Counts from an OpenAI `usage` object (anything else: no tokens)."""
    if not isinstance(usage, dict):
        return Counts(requests=1)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Counts(requests=1, prompt_tokens=_count(usage.get("prompt_tokens")),
                  cached_tokens=_count(cached),
                  completion_tokens=_count(usage.get("completion_tokens")))


def counts_of_body(status_code: int, body: bytes) -> tuple[Counts, bool]:
    """(the Counts of a whole answer, whether its usage was known)."""
    if status_code >= 400:
        return Counts(requests=1, errors=1), False
    try:
        usage = json.loads(body).get("usage")
    except (ValueError, AttributeError):
        return Counts(requests=1), False
    return counts_of_usage(usage), isinstance(usage, dict)


class StreamTap:
    """Watches a stream's frames for its usage chunk and an error event; the frames pass
    through untouched. Only a chunk that carries a usage object is parsed."""

    def __init__(self) -> None:
        self.usage: dict[str, Any] | None = None
        self.has_error = False

    def see(self, chunk: bytes) -> None:
        if _ERROR.search(chunk):
            self.has_error = True
        if _USAGE.search(chunk):
            for line in chunk.split(b"\n"):
                if line.startswith(b"data: ") and _USAGE.search(line):
                    found = _loads(line[6:]).get("usage")
                    if isinstance(found, dict):
                        self.usage = found

    @property
    def counts(self) -> Counts:
        counts = counts_of_usage(self.usage)
        return counts + Counts(errors=1) if self.has_error else counts

    async def relay(self, frames: AsyncIterator[bytes],
                    done: Callable[[StreamTap], Awaitable[None]]) -> AsyncIterator[bytes]:
        """`frames`, watched; `done(self)` once they end, however they end."""
        try:
            async for chunk in frames:
                self.see(chunk)
                yield chunk
        finally:
            aclose = getattr(frames, "aclose", None)
            try:
                if aclose is not None:
                    await aclose()
            finally:
                await done(self)


def _loads(data: bytes) -> dict[str, Any]:
    try:
        found = json.loads(data)
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


__all__ = ["StreamTap", "counts_of_body", "counts_of_usage"]
