"""Chat templates (jinja2) compiled the one way both the model's tokenizer and the gateway's
prompt hasher render them, so the gateway's prompt tokens are the instance's.

The settings are transformers' own: a sandbox, trim_blocks and lstrip_blocks, loop controls,
`tojson`, `raise_exception` and `strftime_now`. A failure caused by the messages is the caller's
mistake (`InvalidRequestError`).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata.errors import InvalidRequestError, ModelLoadError


def _raise_exception(message: str) -> NoReturn:
    raise InvalidRequestError(f"chat template: {message}", param="messages")


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source_text: str, source: str) -> jinja2.Template:
    """The compiled template; a syntax error names `source`."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"{source}: chat template has a syntax error: {e}") from None


def render_chat(template: jinja2.Template, messages: list[dict[str, Any]], *,
                add_generation_prompt: bool, bos_token: str | None,
                eos_token: str | None, tools: list[dict[str, Any]] | None = None) -> str:
    """`messages` rendered into prompt text; errors caused by the messages are 400s. `tools`
    (OpenAI's tool definitions) reach the template as transformers passes them."""
    extra = {} if tools is None else {"tools": tools}
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token or "", eos_token=eos_token or "", **extra)
    except InvalidRequestError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError) as e:
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {e}", param="messages"
        ) from None


__all__ = ["compile_chat_template", "render_chat"]
