"""Completions and chat completions: wire request -> engine requests -> wire responses / SSE.

A choice that ended with finish_reason "error" (the executor failed on it alone, or the engine
died) is never passed off as an answer: a JSON response becomes the error's status and body
(`failure`: 500 `RequestFailedError`, or 503 `EngineDeadError`, which a gateway retries on
another instance), and a stream sends its finish chunk, then an error event, then [DONE].
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from strata import __version__
from strata.clock import Clock
from strata.engine.constraint import TokenConstraint
from strata.engine.outputs import RequestOutput
from strata.engine.request import FinishReason, Request, SamplingParams
from strata.errors import EngineDeadError, RequestFailedError, StrataError
from strata.protocol.openai import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
)
from strata.protocol.sse import DONE_FRAME, encode_event
from strata.server import translate as tr
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.constrain import plan_choices
from strata.server.errors import map_exception
from strata.server.generation import ChoiceState, Generation, Prepare, start, usage
from strata.server.kv_offload import KVOffload
from strata.server.metrics import ServerMetrics
from strata.server.stream_marks import Marks
from strata.server.structured import GrammarService
from strata.server.tools import StreamedAnswer, ToolPlan, answer, with_calls


def fingerprint(config: ServerConfig) -> str:
    """`system_fingerprint`: the Strata release and the model version that computed the answer."""
    return f"strata-{__version__}:{config.served_model_name}@{config.model_version}"


@dataclass(slots=True)
class ServingContext:
    engine: AsyncEngine
    tokenizer: tr.ServerTokenizer
    config: ServerConfig
    metrics: ServerMetrics
    clock: Clock = time.monotonic
    kv_offload: KVOffload | None = None  # set by the app's lifespan when KV offload is on
    fingerprint: str = field(init=False)  # of every response and chunk: computed once
    grammar: GrammarService = field(init=False)  # structured output and forced tool calls

    def __post_init__(self) -> None:
        self.fingerprint = fingerprint(self.config)
        self.grammar = GrammarService(self.tokenizer, getattr(self.engine.engine, "vocab_size",
                                                              None),
                                      simulated=self.config.simulated)


@dataclass(slots=True)
class Started:
    """A generation and the envelope fields of its response. A resumed one (strata/server/
    resume.py) continues a stream another instance began: no role chunk, no echo, logprob text
    offsets from `offsets`."""

    id: str
    model: str
    generation: Generation
    echo_texts: list[str]
    created: int
    prompt_token_ids: list[int] = field(default_factory=list)  # the first prompt's
    is_resumed: bool = False
    offsets: list[int] | None = None
    tools: ToolPlan = field(default_factory=ToolPlan)


def completion_params(ctx: ServingContext, req: CompletionRequest, num_prompt_tokens: int,
                      choice: int, constraint: TokenConstraint | None = None) -> SamplingParams:
    """The sampling of one choice of a completion (a resumed one gets the same); fields left
    out take the model's defaults."""
    num_logprobs = tr.completion_num_logprobs(req, ctx.config)
    defaults = ctx.config.generation_defaults
    max_tokens = tr.resolve_max_tokens(
        req.max_tokens, defaults.max_tokens or tr.COMPLETIONS_DEFAULT_MAX_TOKENS,
        num_prompt_tokens, ctx.engine.max_model_len)
    return tr.sampling_params(req, max_tokens=max_tokens, num_logprobs=num_logprobs,
                              choice=choice, constraint=constraint, defaults=defaults)


def chat_params(ctx: ServingContext, req: ChatCompletionRequest, num_prompt_tokens: int,
                choice: int, constraint: TokenConstraint | None = None) -> SamplingParams:
    """The sampling of one choice of a chat completion (a resumed one gets the same)."""
    num_logprobs = tr.chat_num_logprobs(req, ctx.config)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    defaults = ctx.config.generation_defaults
    max_tokens = tr.resolve_max_tokens(requested, defaults.max_tokens, num_prompt_tokens,
                                       ctx.engine.max_model_len)
    return tr.sampling_params(req, max_tokens=max_tokens, num_logprobs=num_logprobs,
                              choice=choice, constraint=constraint, defaults=defaults)


async def start_completion(ctx: ServingContext, req: CompletionRequest,
                           prepare: Prepare | None = None) -> Started:
    tr.check_common_limits(req, ctx.config)
    prompts = tr.completion_prompts(req, ctx.tokenizer)
    requests: list[Request] = []
    indices: list[int] = []
    rid = tr.new_id("cmpl")
    arrival = ctx.clock()
    for p, prompt in enumerate(prompts):
        for j, constraint in enumerate((await plan_choices(ctx.grammar, req, req.n))[1]):
            params = completion_params(ctx, req, len(prompt), j, constraint)
            requests.append(tr.engine_request(f"{rid}-{len(requests)}", prompt, params, req,
                                              ctx.tokenizer, arrival, loras=ctx.config.loras))
            indices.append(p)
    echo = [ctx.tokenizer.decode(prompts[p]) if req.echo else "" for p in indices]
    generation = await start(ctx.engine, requests, indices, ctx.metrics, ctx.clock,
                             ctx.kv_offload, prepare)
    return Started(rid, req.model or ctx.config.served_model_name, generation, echo,
                   int(time.time()), prompts[0])


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest,
                     prepare: Prepare | None = None) -> Started:
    tr.check_common_limits(req, ctx.config)
    tools, constraints = await plan_choices(ctx.grammar, req, req.n)
    prompt = tr.chat_prompt(req.messages, ctx.tokenizer, tools=tools.template_tools)
    rid, arrival = tr.new_id("chatcmpl"), ctx.clock()
    num_public = tr.public_prefix_tokens(req, prompt, ctx.tokenizer)
    requests = [tr.engine_request(f"{rid}-{j}", prompt, chat_params(ctx, req, len(prompt), j, c),
                                  req, ctx.tokenizer, arrival, num_public,
                                  loras=ctx.config.loras)
                for j, c in enumerate(constraints)]
    generation = await start(ctx.engine, requests, [0] * req.n, ctx.metrics, ctx.clock,
                             ctx.kv_offload, prepare)
    return Started(rid, req.model or ctx.config.served_model_name, generation,
                   [""] * req.n, int(time.time()), prompt, tools=tools)


async def _collect(ctx: ServingContext, started: Started) -> list[ChoiceState]:
    async for i, output in started.generation.outputs():
        started.generation.choices[i].update(output)
    error = failure(ctx, started.generation.choices)
    if error is not None:
        raise error
    return started.generation.choices


def failure(ctx: ServingContext, choices: list[ChoiceState]) -> StrataError | None:
    """The error a generation ended with, if a choice finished with "error"."""
    if not any(c.finish_reason == FinishReason.ERROR for c in choices):
        return None
    if ctx.engine.dead_reason is not None:
        return EngineDeadError(ctx.engine.dead_reason)
    return RequestFailedError("the model failed while generating this request; it failed "
                              "alone and the instance goes on")


def _error_frame(ctx: ServingContext, choices: list[ChoiceState]) -> bytes:
    error = failure(ctx, choices)
    return b"" if error is None else encode_event(map_exception(error).payload())


async def completion_response(ctx: ServingContext, started: Started,
                              with_logprobs: bool) -> CompletionResponse:
    choices = await _collect(ctx, started)
    out = []
    for c in choices:
        echo = started.echo_texts[c.index]
        lps = tr.completion_logprobs(c.logprobs, ctx.tokenizer, len(echo)) \
            if with_logprobs else None
        out.append(CompletionChoice(index=c.index, text=echo + c.text, logprobs=lps,
                                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=started.id, created=started.created, model=started.model,
                              choices=out, usage=usage(choices),
                              system_fingerprint=ctx.fingerprint)


async def chat_response(ctx: ServingContext, started: Started,
                        with_logprobs: bool) -> ChatCompletionResponse:
    choices = await _collect(ctx, started)
    out = []
    for c in choices:
        lps = ChatLogprobs(content=tr.chat_logprobs(c.logprobs, ctx.tokenizer)) \
            if with_logprobs else None
        message, called = answer(c.text, started.tools)
        out.append(ChatChoice(index=c.index, message=message, logprobs=lps,
                              finish_reason=with_calls(c.finish_reason, called),
                              stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=started.id, created=started.created, model=started.model,
                                  choices=out, usage=usage(choices),
                                  system_fingerprint=ctx.fingerprint)


async def completion_stream(ctx: ServingContext, started: Started, with_logprobs: bool,
                            include_usage: bool,
                            marks: Marks | None = None) -> AsyncGenerator[bytes, None]:
    """SSE frames of a streamed completion; the echo rides on each choice's first chunk."""
    choices = started.generation.choices
    offsets = started.offsets or [len(e) for e in started.echo_texts]

    def chunk(items: list[CompletionChoice]) -> bytes:
        return encode_event(CompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=items,
            system_fingerprint=ctx.fingerprint))

    async for i, output in started.generation.outputs():
        choices[i].update(output)
        echo, started.echo_texts[i] = started.echo_texts[i], ""
        lps = None
        if with_logprobs:
            lps = tr.completion_logprobs(output.new_logprobs, ctx.tokenizer, offsets[i])
            offsets[i] += sum(len(t) for t in lps.tokens)
        frame = b""
        if echo or output.new_text or output.finished or lps is not None:
            frame = chunk([CompletionChoice(index=i, text=echo + output.new_text, logprobs=lps,
                                            finish_reason=_reason(output),
                                            stop_reason=output.stop_reason)])
        if frame := marks.on(output, frame) if marks is not None else frame:
            yield frame
    if error_frame := _error_frame(ctx, choices):
        yield error_frame
    if include_usage:
        yield encode_event(CompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=[],
            usage=usage(choices), system_fingerprint=ctx.fingerprint))
    yield DONE_FRAME


async def chat_stream(ctx: ServingContext, started: Started, with_logprobs: bool,
                      include_usage: bool,
                      marks: Marks | None = None) -> AsyncGenerator[bytes, None]:
    """SSE frames of a streamed chat completion: a role chunk per choice, deltas, finish."""
    choices = started.generation.choices

    def chunk(items: list[ChatStreamChoice]) -> bytes:
        return encode_event(ChatCompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=items,
            system_fingerprint=ctx.fingerprint))

    answers = [StreamedAnswer(started.tools) for _ in choices]
    if started.is_resumed:  # the parser reads what the first instance sent, sending nothing
        answers[0].delta(choices[0].text, finished=False)
    for c in choices if not started.is_resumed else []:
        role = chunk([ChatStreamChoice(index=c.index,
                                       delta=DeltaMessage(role="assistant", content=""))])
        yield marks.first_frame(role) if marks is not None else role
    async for i, output in started.generation.outputs():
        choices[i].update(output)
        lps = ChatLogprobs(content=tr.chat_logprobs(output.new_logprobs, ctx.tokenizer)) \
            if with_logprobs else None
        frame = b""
        delta = answers[i].delta(output.new_text, output.finished)
        if delta is not None or output.finished or lps is not None:
            frame = chunk([ChatStreamChoice(
                index=i, delta=delta or DeltaMessage(), logprobs=lps,
                finish_reason=with_calls(_reason(output), answers[i].called))])
        if frame := marks.on(output, frame) if marks is not None else frame:
            yield frame
    if error_frame := _error_frame(ctx, choices):
        yield error_frame
    if include_usage:
        yield encode_event(ChatCompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=[],
            usage=usage(choices), system_fingerprint=ctx.fingerprint))
    yield DONE_FRAME


def _reason(output: RequestOutput) -> str | None:
    if not output.finished or output.finish_reason is None:
        return None
    return output.finish_reason.value


__all__ = ["ServingContext", "Started", "chat_params", "chat_response", "chat_stream",
           "completion_params", "completion_response", "completion_stream", "start_chat",
           "start_completion"]
