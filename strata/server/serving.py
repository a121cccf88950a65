"""Completions and chat completions: wire request -> engine requests -> wire responses / SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from strata import __version__
from strata.engine.constraint import TokenConstraint
from strata.engine.outputs import RequestOutput
from strata.engine.request import Request
from strata.errors import InvalidRequestError
from strata.model.generation_defaults import GenerationDefaults
from strata.model.grammar import GrammarSpec
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
from strata.server.generation import ChoiceState, Generation, start, usage
from strata.server.kv_offload import KVOffload
from strata.server.metrics import ServerMetrics
from strata.server.structured import GrammarService, grammar_spec
from strata.server.tools import StreamedAnswer, ToolPlan, answer, tool_plan


def fingerprint(config: ServerConfig) -> str:
    """`system_fingerprint`: the Strata release and the model version that computed the answer."""
    return f"strata-{__version__}:{config.served_model_name}@{config.model_version}"


@dataclass(slots=True)
class ServingContext:
    engine: AsyncEngine
    tokenizer: tr.ServerTokenizer
    config: ServerConfig
    metrics: ServerMetrics
    clock: Callable[[], float] = time.monotonic
    kv_offload: KVOffload | None = None  # set by the app's lifespan when KV offload is on
    fingerprint: str = field(init=False)  # of every response and chunk: computed once
    grammar: GrammarService = field(init=False)  # structured output

    @property
    def defaults(self) -> GenerationDefaults:
        return self.config.generation_defaults

    def __post_init__(self) -> None:
        self.fingerprint = fingerprint(self.config)
        self.grammar = GrammarService(self.tokenizer, getattr(self.engine.engine, "vocab_size",
                                                              None),
                                      simulated=self.config.simulated)

    async def constraints(self, spec: GrammarSpec | None,
                          n: int) -> list[TokenConstraint] | list[None]:
        """One constraint per choice for `spec` (None: unconstrained)."""
        if spec is None:
            return [None] * n
        return await self.grammar.constraints(spec, n)


@dataclass(slots=True)
class Started:
    """A generation and the envelope fields of its response."""

    id: str
    model: str
    generation: Generation
    echo_texts: list[str]
    created: int
    tools: ToolPlan = field(default_factory=ToolPlan)


async def start_completion(ctx: ServingContext, req: CompletionRequest) -> Started:
    tr.check_common_limits(req, ctx.config)
    num_logprobs = tr.completion_num_logprobs(req, ctx.config)
    prompts = tr.completion_prompts(req, ctx.tokenizer)
    spec = grammar_spec(req)
    requests: list[Request] = []
    indices: list[int] = []
    rid = tr.new_id("cmpl")
    arrival = ctx.clock()
    for p, prompt in enumerate(prompts):
        max_tokens = tr.resolve_max_tokens(req.max_tokens, ctx.defaults.max_tokens
                                           or tr.COMPLETIONS_DEFAULT_MAX_TOKENS,
                                           len(prompt), ctx.engine.max_model_len)
        for j, constraint in enumerate(await ctx.constraints(spec, req.n)):
            params = tr.sampling_params(req, max_tokens=max_tokens, num_logprobs=num_logprobs,
                                        choice=j, constraint=constraint, defaults=ctx.defaults)
            requests.append(tr.engine_request(f"{rid}-{len(requests)}", prompt, params, req,
                                              ctx.tokenizer, arrival))
            indices.append(p)
    echo = [ctx.tokenizer.decode(prompts[p]) if req.echo else "" for p in indices]
    generation = await start(ctx.engine, requests, indices, ctx.metrics, ctx.clock,
                             ctx.kv_offload)
    return Started(rid, req.model or ctx.config.served_model_name, generation, echo,
                   int(time.time()))


async def start_chat(ctx: ServingContext, req: ChatCompletionRequest) -> Started:
    tr.check_common_limits(req, ctx.config)
    num_logprobs = tr.chat_num_logprobs(req, ctx.config)
    tools, spec = tool_plan(req), grammar_spec(req)
    if tools.spec is not None and spec is not None:
        raise InvalidRequestError(f"{spec.param}: a forced tool call (tool_choice) and "
                                  "structured output cannot be combined", param=spec.param)
    prompt = tr.chat_prompt(req.messages, ctx.tokenizer, tools=tools.template_tools)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_tokens = tr.resolve_max_tokens(requested, ctx.defaults.max_tokens, len(prompt),
                                       ctx.engine.max_model_len)
    constraints = await ctx.constraints(tools.spec or spec, req.n)
    rid, arrival = tr.new_id("chatcmpl"), ctx.clock()
    requests = [
        tr.engine_request(f"{rid}-{j}", prompt, tr.sampling_params(
            req, max_tokens=max_tokens, num_logprobs=num_logprobs, choice=j,
            constraint=constraint, defaults=ctx.defaults), req, ctx.tokenizer, arrival)
        for j, constraint in enumerate(constraints)
    ]
    generation = await start(ctx.engine, requests, [0] * req.n, ctx.metrics, ctx.clock,
                             ctx.kv_offload)
    return Started(rid, req.model or ctx.config.served_model_name, generation,
                   [""] * req.n, int(time.time()), tools)


async def _collect(started: Started) -> list[ChoiceState]:
    async for i, output in started.generation.outputs():
        started.generation.choices[i].update(output)
    return started.generation.choices


async def completion_response(ctx: ServingContext, started: Started,
                              with_logprobs: bool) -> CompletionResponse:
    choices = await _collect(started)
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
    choices = await _collect(started)
    out = []
    for c in choices:
        lps = ChatLogprobs(content=tr.chat_logprobs(c.logprobs, ctx.tokenizer)) \
            if with_logprobs else None
        message, called = answer(c.text, started.tools)
        out.append(ChatChoice(index=c.index, message=message, logprobs=lps,
                              finish_reason=_with_calls(c.finish_reason, called),
                              stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=started.id, created=started.created, model=started.model,
                                  choices=out, usage=usage(choices),
                                  system_fingerprint=ctx.fingerprint)


async def completion_stream(ctx: ServingContext, started: Started, with_logprobs: bool,
                            include_usage: bool) -> AsyncGenerator[bytes, None]:
    """SSE frames of a streamed completion; the echo rides on each choice's first chunk."""
    choices = started.generation.choices
    offsets = [len(e) for e in started.echo_texts]

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
        if echo or output.new_text or output.finished or lps is not None:
            yield chunk([CompletionChoice(index=i, text=echo + output.new_text, logprobs=lps,
                                          finish_reason=_reason(output),
                                          stop_reason=output.stop_reason)])
    if include_usage:
        yield encode_event(CompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=[],
            usage=usage(choices), system_fingerprint=ctx.fingerprint))
    yield DONE_FRAME


async def chat_stream(ctx: ServingContext, started: Started, with_logprobs: bool,
                      include_usage: bool) -> AsyncGenerator[bytes, None]:
    """SSE frames of a streamed chat completion: a role chunk per choice, deltas, finish."""
    choices = started.generation.choices

    def chunk(items: list[ChatStreamChoice]) -> bytes:
        return encode_event(ChatCompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=items,
            system_fingerprint=ctx.fingerprint))

    answers = [StreamedAnswer(started.tools) for _ in choices]
    for c in choices:
        yield chunk([ChatStreamChoice(index=c.index,
                                      delta=DeltaMessage(role="assistant", content=""))])
    async for i, output in started.generation.outputs():
        choices[i].update(output)
        lps = ChatLogprobs(content=tr.chat_logprobs(output.new_logprobs, ctx.tokenizer)) \
            if with_logprobs else None
        delta = answers[i].delta(output.new_text, output.finished)
        if delta is not None or output.finished or lps is not None:
            yield chunk([ChatStreamChoice(
                index=i, delta=delta or DeltaMessage(), logprobs=lps,
                finish_reason=_with_calls(_reason(output), answers[i].called))])
    if include_usage:
        yield encode_event(ChatCompletionStreamResponse(
            id=started.id, created=started.created, model=started.model, choices=[],
            usage=usage(choices), system_fingerprint=ctx.fingerprint))
    yield DONE_FRAME


def _with_calls(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def _reason(output: RequestOutput) -> str | None:
    if not output.finished or output.finish_reason is None:
        return None
    return output.finish_reason.value


__all__ = ["ServingContext", "Started", "chat_response", "chat_stream", "completion_response",
           "completion_stream", "start_chat", "start_completion"]
