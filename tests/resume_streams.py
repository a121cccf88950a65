"""Reading marked SSE streams in tests of mid-stream resume (strata/protocol/resume.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from strata.protocol.resume import MARK, read_mark


@dataclass
class Frame:
    marks: list[dict[str, Any]] = field(default_factory=list)
    data: list[str] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for mark in self.marks for t in mark.get("t", [])]

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(d) for d in self.data if d != "[DONE]"]


def frames_of(raw: bytes) -> list[Frame]:
    """Every frame of a whole stream, with its marks and data lines."""
    frames = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        frame = Frame()
        for line in block.split(b"\n"):
            if line.startswith(MARK):
                frame.marks.append(read_mark(line))
            elif line.startswith(b"data: "):
                frame.data.append(line[6:].decode())
        frames.append(frame)
    return frames


def text_of(events: list[dict[str, Any]]) -> str:
    """The text of chat deltas or completion chunks."""
    parts = []
    for event in events:
        for choice in event.get("choices", []):
            delta = choice.get("delta")
            parts.append((delta.get("content") if delta else choice.get("text")) or "")
    return "".join(parts)


def events_of(frames: list[Frame]) -> list[dict[str, Any]]:
    return [e for f in frames for e in f.events]


def cut_after_tokens(frames: list[Frame], num_tokens: int) -> tuple[list[Frame], list[int]]:
    """The frames a client had received once `num_tokens` token ids were marked, and the ids."""
    sent: list[int] = []
    for i, frame in enumerate(frames):
        sent += frame.token_ids
        if len(sent) >= num_tokens:
            return frames[: i + 1], sent
    raise AssertionError(f"the stream marked only {len(sent)} tokens")


def usage_of(events: list[dict[str, Any]]) -> tuple[int, int, int] | None:
    """(prompt, completion, total) tokens of the usage chunk (cached tokens depend on where
    the stream ran)."""
    found = [e["usage"] for e in events if e.get("usage")]
    if not found:
        return None
    usage = found[-1]
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


__all__ = ["Frame", "cut_after_tokens", "events_of", "frames_of", "text_of", "usage_of"]
