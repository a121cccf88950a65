"""Request fields beyond the first OpenAI surface, shared by completions and chat completions:
vLLM's extra sampling fields, OpenAI's `response_format`, and vLLM's structured-output fields.

Structured output comes from one of:
- `response_format`: `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}` (OpenAI);
- `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}` (vLLM
  >= 0.10.2; exactly one key);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older names).
Only one of them per request. Options Strata cannot honour (`structural_tag`,
`whitespace_pattern`) are refused naming the field, never ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Wire):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


_REFUSED_OPTIONS = ("structural_tag", "whitespace_pattern")


class StructuredOutputs(_Wire):
    """vLLM's `structured_outputs`; `disable_any_whitespace` and `disable_additional_properties`
    are accepted as no-ops (Strata's JSON never has free whitespace and is always strict);
    `disable_fallback` too (there is no fallback backend)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_options(cls, data: object) -> object:
        if isinstance(data, dict):
            for name in _REFUSED_OPTIONS:
                if data.get(name) is not None:
                    raise ValueError(f"structured_outputs.{name} is not supported by Strata")
        return data


class SamplingExtensions(_Wire):
    """vLLM's sampling fields beyond OpenAI's, and OpenAI's logit_bias."""

    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None


class StructuredOutputFields(_Wire):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


def _is_set(value: object) -> bool:
    return value not in (None, False, "", [], {})


# Fields of OpenAI's or vLLM's API that Strata does not implement, refused when used (a field
# the request model declares is never refused: `tools` is a chat field, not a completions one).
_UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "tools": _is_set,
    "functions": _is_set,
    "tool_choice": lambda v: _is_set(v) and v != "none",
    "function_call": lambda v: _is_set(v) and v != "none",
    "best_of": lambda v: _is_set(v) and v != 1,
    "suffix": _is_set,
    "min_p": lambda v: _is_set(v) and v != 0,
    "prediction": _is_set,
    "audio": _is_set,
    "modalities": lambda v: _is_set(v) and v != ["text"],
    "web_search_options": _is_set,
    "truncate_prompt_tokens": _is_set,
    "prompt_logprobs": _is_set,
    "use_beam_search": _is_set,
}


def unsupported_field(data: object, declared: Collection[str]) -> str | None:
    """The first field of `data` that Strata would have to ignore, or None."""
    if not isinstance(data, dict):
        return None
    return next((name for name, is_used in _UNSUPPORTED.items()
                 if name in data and name not in declared and is_used(data[name])), None)


__all__ = ["JsonSchemaFormat", "ResponseFormat", "SamplingExtensions", "StructuredOutputFields",
           "StructuredOutputs", "unsupported_field"]
