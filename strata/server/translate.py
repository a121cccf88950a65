"""Wire requests -> engine `Request`s, and engine logprobs -> wire logprobs.

Every per-request limit is checked here, before anything is queued, so a bad parameter is a 400
at once. Token texts come from the tokenizer: `id_to_token_text` for logprobs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from itertools import takewhile
from typing import Protocol, TypeVar

from pydantic import BaseModel

from strata.engine.constraint import TokenConstraint
from strata.engine.request import INT64_MAX, INT64_MIN, Logprob, Request, SamplingParams
from strata.errors import InvalidRequestError
from strata.model.generation_defaults import GenerationDefaults
from strata.protocol.openai import (
    ChatCompletionRequest,
    ChatLogprobToken,
    ChatMessage,
    ChatTopLogprob,
    CompletionLogprobs,
    CompletionRequest,
)
from strata.protocol.priority import effective_priority
from strata.server.config import ServerConfig
from strata.types import RequestId

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
NO_DEFAULTS = GenerationDefaults()
_T = TypeVar("_T")


class ServerTokenizer(Protocol):
    """The part of `strata.model.tokenizer.Tokenizer` the server uses."""

    eos_token_ids: tuple[int, ...]
    vocab_size: int

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str: ...

    def id_to_token_text(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, object]], *,
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, object]] | None = None) -> str: ...


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _fail(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {message}", param=param)


def check_common_limits(req: CompletionRequest | ChatCompletionRequest,
                        config: ServerConfig) -> None:
    """n and stop limits shared by both endpoints."""
    if not 1 <= req.n <= config.max_n:
        raise _fail("n", f"must be in 1..{config.max_n}, got {req.n}")
    if len(req.stop_list) > config.max_stop_strings:
        raise _fail("stop", f"allows at most {config.max_stop_strings} strings, "
                            f"got {len(req.stop_list)}")
    if req.stream_options is not None and not req.stream:
        raise _fail("stream_options", "is only allowed when stream is true")


def completion_num_logprobs(req: CompletionRequest, config: ServerConfig) -> int | None:
    if req.logprobs is not None and not 0 <= req.logprobs <= config.max_top_logprobs:
        raise _fail("logprobs", f"must be in 0..{config.max_top_logprobs}, got {req.logprobs}")
    if req.echo and req.logprobs is not None:
        raise _fail("echo", "is not supported together with logprobs (no prompt logprobs)")
    return req.logprobs


def chat_num_logprobs(req: ChatCompletionRequest, config: ServerConfig) -> int | None:
    top = req.top_logprobs
    if top is not None and not 0 <= top <= config.max_top_logprobs:
        raise _fail("top_logprobs", f"must be in 0..{config.max_top_logprobs}, got {top}")
    if top is not None and not req.logprobs:
        raise _fail("top_logprobs", "requires logprobs to be true")
    return (top or 0) if req.logprobs else None


def completion_prompts(req: CompletionRequest, tokenizer: ServerTokenizer) -> list[list[int]]:
    """One token list per prompt (a list of strings or of token lists is a batch)."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=True)]
    if not prompt:
        raise _fail("prompt", "must not be an empty list")
    if isinstance(prompt[0], str):
        return [tokenizer.encode(str(p), add_special_tokens=True) for p in prompt]
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for m in messages:
        item: dict[str, object] = {"role": m.role, "content": m.text}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.tool_calls:  # arguments as a dict, as templates expect (a string if not JSON)
            item["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in m.tool_calls]
        out.append(item)
    return out


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def chat_prompt(messages: Sequence[ChatMessage], tokenizer: ServerTokenizer,
                add_generation_prompt: bool = True,
                tools: list[dict[str, object]] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(chat_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools)
    return tokenizer.encode(text, add_special_tokens=False)


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt: int,
                       max_model_len: int) -> int:
    """The explicit value as is (the engine refuses it if it does not fit); else the default
    capped to the room left (at least 1, so an over-long prompt gets the context error)."""
    if requested is not None:
        return requested
    room = max(max_model_len - num_prompt, 1)
    return room if default is None else max(min(default, room), 1)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int,
                    num_logprobs: int | None, choice: int,
                    constraint: TokenConstraint | None = None,
                    defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
    """SamplingParams validates the ranges itself (InvalidRequestError naming the param).
    A field the request leaves out takes the model's default, else Strata's."""
    seed = None if req.seed is None else _choice_seed(req.seed, choice)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_first(req.temperature, defaults.temperature, 1.0),
        top_p=_first(req.top_p, defaults.top_p, 1.0),
        top_k=_first(req.top_k, defaults.top_k, 0),
        seed=seed,
        stop=tuple(req.stop_list),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=num_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=_first(req.repetition_penalty, defaults.repetition_penalty, 1.0),
        min_tokens=req.min_tokens or 0,
        logit_bias=logit_bias(req.logit_bias),
        constraint=constraint,
    )


def _first(*values: _T | None) -> _T:
    return next(v for v in values if v is not None)


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; the engine checks ids against the
    vocabulary, SamplingParams the range of the values."""
    if not bias:
        return ()
    try:
        return tuple((int(k), float(v)) for k, v in bias.items())
    except ValueError:
        raise _fail("logit_bias", "keys must be token ids (integers as strings)") from None


def _choice_seed(seed: int, choice: int) -> int:
    """seed + choice (choices differ, runs reproduce), wrapped to stay an int64."""
    if not INT64_MIN <= seed <= INT64_MAX:
        raise _fail("seed", f"must be a 64-bit signed integer (-2**63 .. 2**63-1), got {seed}")
    return (seed + choice - INT64_MIN) % (1 << 64) + INT64_MIN


def engine_request(request_id: str, prompt: list[int], params: SamplingParams,
                   req: CompletionRequest | ChatCompletionRequest,
                   tokenizer: ServerTokenizer, arrival_s: float,
                   num_public_tokens: int = 0, loras: Mapping[str, str] | None = None) -> Request:
    """The engine's request; `loras` (name -> digest): a `model` naming one runs with it."""
    lora = req.model if loras and req.model and req.model in loras else ""
    return Request(request_id=RequestId(request_id), prompt_token_ids=prompt,
                   sampling_params=params, eos_token_ids=tuple(tokenizer.eos_token_ids),
                   arrival_time=arrival_s, priority=effective_priority(None, req.priority, None),
                   cache_salt=req.cache_salt or "", num_public_tokens=num_public_tokens,
                   lora_name=lora, lora_digest=loras[lora] if loras and lora else "")


R = TypeVar("R", bound=BaseModel)  # a wire request with a `cache_salt` field


def tenant_scoped(req: R, tenant: str | None) -> R:
    """The request with its tenant in `cache_salt` (None: a server without keys, one tenant), so
    that no tenant's prompt is ever served from, or probed through, another's KV blocks."""
    if tenant is None:
        return req
    salt = getattr(req, "cache_salt", None)
    return req.model_copy(update={"cache_salt": f"{tenant}:{salt or ''}"})


def public_prefix_tokens(req: ChatCompletionRequest, prompt: list[int],
                         tokenizer: ServerTokenizer) -> int:
    """With `share_system_prompt`, how many leading tokens of `prompt` are the leading system
    (or developer) messages: their full blocks are cached for every tenant to share."""
    lead = list(takewhile(lambda m: m.role in ("system", "developer"), req.messages))
    if not req.share_system_prompt or not lead:
        return 0
    try:
        public = chat_prompt(lead, tokenizer, add_generation_prompt=False)
    except Exception:  # a template that refuses a conversation of system messages only
        return 0
    num = 0
    for a, b in zip(public, prompt, strict=False):
        if a != b:
            break
        num += 1
    return num


def completion_logprobs(logprobs: list[Logprob], tokenizer: ServerTokenizer,
                        offset: int) -> CompletionLogprobs:
    """The completions format; `offset` is where the first token's text starts."""
    out = CompletionLogprobs()
    for lp in logprobs:
        text = tokenizer.id_to_token_text(lp.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for token_id, value in lp.top:  # distinct ids may share a text: keep the likeliest
            top.setdefault(tokenizer.id_to_token_text(token_id), value)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(logprobs: list[Logprob], tokenizer: ServerTokenizer) -> list[ChatLogprobToken]:
    """The chat format: token, logprob, UTF-8 bytes and the top alternatives."""
    return [
        ChatLogprobToken(**_top_entry(lp.token_id, lp.logprob, tokenizer).model_dump(),
                         top_logprobs=[_top_entry(t, v, tokenizer) for t, v in lp.top])
        for lp in logprobs
    ]


def _top_entry(token_id: int, logprob: float, tokenizer: ServerTokenizer) -> ChatTopLogprob:
    text = tokenizer.id_to_token_text(token_id)
    return ChatTopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "ServerTokenizer",
    "chat_logprobs",
    "chat_num_logprobs",
    "chat_prompt",
    "check_common_limits",
    "completion_logprobs",
    "completion_num_logprobs",
    "completion_prompts",
    "engine_request",
    "new_id",
    "resolve_max_tokens",
    "public_prefix_tokens",
    "sampling_params",
    "tenant_scoped",
]
