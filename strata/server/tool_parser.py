"""Tool calls read out of the model's text as it streams, in the Hermes format that Qwen2.5,
Qwen3, Hermes and many other chat templates teach:

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Oslo"}}
    </tool_call>

`ToolCallParser.feed` takes each new piece of text and returns what it means so far: content
(text outside the tags; a tail that could start a tag is held back) and `CallDelta`s. A call
whose JSON starts `{"name": "...", "arguments": ` (how forced calls are generated, and how the
templates ask) streams: its name first, then its arguments as they come, less a trailing `}`
that may close the call; any other layout is sent whole when its `</tool_call>` arrives. A body
that is not a JSON object with a string name is returned as content, tags and all.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}?\s*$")


@dataclass(frozen=True, slots=True)
class CallDelta:
    """News of call `index`: its id and name on the first delta, then argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallParser:
    """Splits a choice's streamed text into content and tool-call deltas."""

    pending: str = ""  # text not yet returned: a partial tag, or the open call's body
    in_call: bool = False
    num_calls: int = 0
    streamed_head: bool = False  # the open call's id and name were sent
    sent_arguments: int = 0  # characters of the open call's arguments sent

    def feed(self, text: str) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if not self.in_call:
                start = self.pending.find(OPEN)
                if start < 0:
                    keep = _partial_tag_len(self.pending, OPEN)
                    cut = len(self.pending) - keep
                    out.content += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    return out
                out.content += self.pending[:start]
                self.pending = self.pending[start + len(OPEN):]
                self.in_call, self.streamed_head, self.sent_arguments = True, False, 0
                continue
            end = self.pending.find(CLOSE)
            if end < 0:
                out.calls += self._stream_open_call(self.pending)
                return out
            body, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
            self.in_call = False
            self._close_call(body, out)

    def finish(self) -> Parsed:
        """The end of the text: an unclosed call is closed if its JSON is whole."""
        out = Parsed()
        if self.in_call:
            self.in_call = False
            self._close_call(self.pending, out)
        else:
            out.content = self.pending
        self.pending = ""
        return out

    def _stream_open_call(self, body: str) -> list[CallDelta]:
        body = body[:len(body) - _partial_tag_len(body, CLOSE)]
        head = _HEAD.match(body)
        if head is None:
            return []
        deltas = []
        if not self.streamed_head:
            self.streamed_head = True
            deltas.append(CallDelta(self.num_calls, new_call_id(), _unescape(head.group(1))))
        arguments = body[head.end():]
        ready = len(arguments) - len(_TAIL.search(arguments).group(0))  # type: ignore[union-attr]
        if ready > self.sent_arguments:
            deltas.append(CallDelta(self.num_calls,
                                    arguments=arguments[self.sent_arguments:ready]))
            self.sent_arguments = ready
        return deltas

    def _close_call(self, body: str, out: Parsed) -> None:
        call = _call_of(body)
        if call is None:
            if self.streamed_head:  # a streamed call never turns back into content
                self.num_calls += 1
            else:
                out.content += OPEN + body + CLOSE
            return
        name, arguments = call
        if self.streamed_head:
            head = _HEAD.match(body)
            assert head is not None
            text = body[head.end():].rstrip()
            text = text[:-1] if text.endswith("}") else text  # the call's own closing brace
            rest = text.rstrip()[self.sent_arguments:]
            if rest:
                out.calls.append(CallDelta(self.num_calls, arguments=rest))
        else:
            text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                            ensure_ascii=False)
            out.calls.append(CallDelta(self.num_calls, new_call_id(), name, text))
        self.num_calls += 1


def parse_all(text: str) -> tuple[str, list[tuple[str, str, str]]]:
    """The content and the (id, name, arguments) of each call in a whole answer."""
    parser = ToolCallParser()
    first, last = parser.feed(text), parser.finish()
    calls: dict[int, list[str]] = {}
    for d in first.calls + last.calls:
        entry = calls.setdefault(d.index, [d.id or "", d.name or "", ""])
        entry[2] += d.arguments
    return first.content + last.content, [(i, n, a) for i, n, a in calls.values()]


def _call_of(body: str) -> tuple[str, object] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], call.get("arguments", call.get("parameters", {}))


def _partial_tag_len(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _unescape(name: str) -> str:
    return str(json.loads(f'"{name}"'))


__all__ = ["CLOSE", "OPEN", "CallDelta", "Parsed", "ToolCallParser", "new_call_id", "parse_all"]
