"""Tool calling on the wire (OpenAI's chat completions shape).

Requests: `tools` (functions with a JSON schema of their parameters), `tool_choice` (`"auto"`,
`"none"`, `"required"` or `{"type": "function", "function": {"name": ...}}`) and
`parallel_tool_calls`; messages carry the assistant's earlier `tool_calls` and the `tool`
results (`tool_call_id`). Responses: `message.tool_calls` and, streamed, `delta.tool_calls`
whose entries carry an `index` (the call's position), the id, type and name on a call's first
delta, and pieces of the `arguments` string after it. The legacy `functions`/`function_call`
fields stay refused (openai.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Out(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Wire):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Wire):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolRequestFields(_Wire):
    """The chat request's tool fields (how they fit together is checked by the server)."""

    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class CalledFunction(_Wire):
    name: str
    arguments: str


class MessageToolCall(_Wire):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class MessageToolFields(_Wire):
    """An earlier assistant turn's calls, or the id a `tool` message answers."""

    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionCall(_Out):
    name: str
    arguments: str


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sparse(_Out):
    """Serialized without its unset (None) fields: a later delta of a call carries only
    `index` and `function.arguments`, and clients merge deltas key by key (a null would
    overwrite the call's type or name)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_Sparse):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Sparse):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


__all__ = ["CalledFunction", "FunctionCall", "FunctionCallDelta", "FunctionDefinition",
           "MessageToolCall", "MessageToolFields", "NamedFunction", "NamedToolChoice",
           "ToolCall", "ToolCallDelta", "ToolChoice", "ToolDefinition", "ToolRequestFields"]
