"""Tool calling on the instance: what a request's tools mean for the prompt, the grammar and the
answer.

`tool_plan` reads `tools`, `tool_choice` and `parallel_tool_calls`:
- the tools go to the chat template (as transformers passes them: a list of
  `{"type": "function", "function": {...}}`), whatever the choice;
- `none`: the answer is text; `auto` (the default with tools): the model decides, and calls in
  its text (tool_parser.py's Hermes format) become `tool_calls`; with `parallel_tool_calls:
  false` only its first call does (later ones are dropped, streamed or not, as vLLM does);
- `required` or a named function: the answer is constrained to one or more calls (one with
  `parallel_tool_calls: false`) in that same format, each call's `arguments` to its function's
  JSON schema (llguidance, strata/model/grammar.py), so every forced call parses and validates.
`answer` and `StreamedAnswer` turn a choice's text into the message or the streamed deltas; a
choice that called a tool finishes with `tool_calls`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from strata.errors import InvalidRequestError
from strata.model.grammar import GrammarSpec
from strata.protocol.openai import ChatCompletionRequest, ChatResponseMessage, DeltaMessage
from strata.protocol.tools import (
    FunctionCall,
    FunctionCallDelta,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    ToolDefinition,
)
from strata.server.tool_parser import CLOSE, OPEN, ToolCallParser, parse_all

_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None = None  # for the chat template
    spec: GrammarSpec | None = None  # forced calls
    reads_calls: bool = False  # calls in the text become tool_calls
    max_calls: int | None = None  # 1 with `parallel_tool_calls: false`; None: no limit


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    """What the request's tools mean; a choice that fits no given tool is a 400."""
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", param="tools")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not "
                                  "among tools", param="tool_choice")
    if choice == "required" and not names:
        raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
    if not req.tools:
        return ToolPlan()
    template_tools = [t.model_dump(exclude_none=True) for t in req.tools]
    choice = choice or "auto"
    max_calls = None if req.parallel_tool_calls else 1
    if choice == "none":
        return ToolPlan(template_tools)
    if choice == "auto":
        return ToolPlan(template_tools, reads_calls=True, max_calls=max_calls)
    forced = req.tools if choice == "required" else [
        t for t in req.tools if isinstance(choice, NamedToolChoice)
        and t.function.name == choice.function.name]
    spec = GrammarSpec("grammar", calls_lark(forced, parallel=req.parallel_tool_calls),
                       "tool_choice")
    return ToolPlan(template_tools, spec, reads_calls=True, max_calls=max_calls)


def calls_lark(tools: list[ToolDefinition], *, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, `%json` for each function's call object) of one
    call, or of calls separated by newlines."""
    more = ' ("\\n" call)*' if parallel else ""
    rules = [f"start: call{more}",
             f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}",
             "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        rules.append(f"fn{i}: %json {json.dumps(_call_schema(tool))}")
    return "\n".join(rules)


def _call_schema(tool: ToolDefinition) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object"}
    return {"type": "object", "x-guidance": _LAYOUT,
            "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def answer(text: str, plan: ToolPlan) -> tuple[ChatResponseMessage, bool]:
    """The message of a finished choice, and whether it called a tool."""
    if not plan.reads_calls:
        return ChatResponseMessage(content=text), False
    content, calls = parse_all(text)
    calls = calls[: plan.max_calls]
    if not calls:
        return ChatResponseMessage(content=text), False
    return ChatResponseMessage(content=content.strip() or None, tool_calls=[
        ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in calls]), True


def with_calls(reason: str | None, called: bool) -> str | None:
    """A choice that called a tool and stopped finishes with `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass(slots=True)
class StreamedAnswer:
    """One choice's deltas: content, and tool-call deltas in OpenAI's shape."""

    plan: ToolPlan
    parser: ToolCallParser = field(default_factory=ToolCallParser)

    @property
    def called(self) -> bool:
        return self.parser.num_calls > 0 or self.parser.streamed_head

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta for `text` (None: nothing to send yet)."""
        if not self.plan.reads_calls:
            return DeltaMessage(content=text) if text else None
        parsed = self.parser.feed(text)
        if finished:
            last = self.parser.finish()
            parsed.content += last.content
            parsed.calls += last.calls
        content = parsed.content
        if self.called and not content.strip():
            content = ""  # the newlines between calls
        limit = self.plan.max_calls
        calls = [ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                               function=FunctionCallDelta(name=d.name, arguments=d.arguments))
                 for d in parsed.calls if limit is None or d.index < limit]
        if not content and not calls:
            return None
        return DeltaMessage(content=content or None, tool_calls=calls or None)


__all__ = ["StreamedAnswer", "ToolPlan", "answer", "calls_lark", "tool_plan", "with_calls"]
