"""Streams that outlive their instance: the instance's side of strata/protocol/resume.py.

    marks_for   a stream started here is marked (token ids, the rendered prompt) when the
                gateway may need to resume it: `X-Strata-Resumable: 1` and one choice
    resume      POST /v1/strata/resume: go on with a stream another instance began

A resumed generation is the first one's continuation: the same prompt ids (a chat template and a
session's history are not rendered again), the tokens sent counted as generated (the remaining
max_tokens; a seeded sampler at its position; penalties over them), the detokenizer replayed so
that a stop string across the hand-over is found and no character is sent twice (the engine does
it, strata/engine/detokenizer.py). Usage counts the original prompt and every generated token.

A session turn is stored by the instance that finishes the stream, with the revision the first
answer announced (`X-Session-Revision` - 1 as the expected one), once: if that append conflicts
because the first instance stored this very turn before it died (between its last token and
[DONE]), the turn counts as stored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from strata.engine.detokenizer import final_text, released_text
from strata.engine.request import Request as EngineRequest
from strata.errors import InvalidRequestError, SessionConflictError
from strata.protocol.openai import ChatCompletionRequest, CompletionRequest
from strata.protocol.resume import RESUMABLE_HEADER, RESUME_PATH, ResumeFinish, ResumeRequest
from strata.server import serving
from strata.server import sessions as sess
from strata.server import translate as tr
from strata.server.constrain import plan_choices
from strata.server.generation import ChoiceState, Generation, start
from strata.server.instance import Instance, check_model, instance_of
from strata.server.preamble import admitted, hold_adapter, parse_body
from strata.server.request_io import SSEResponse, unless_cancelled
from strata.server.serving import ServingContext, Started
from strata.server.stream_marks import Marks

ClientRequest = ChatCompletionRequest | CompletionRequest


def marks_for(request: Request, ctx: ServingContext, started: Started) -> Marks | None:
    """The marks of a stream started here, when the gateway asked and it has one choice."""
    if request.headers.get(RESUMABLE_HEADER) != "1" or len(started.generation.choices) != 1:
        return None
    return Marks.first(id=started.id, created=started.created,
                       version=f"{ctx.config.served_model_name}@{ctx.config.model_version}",
                       prompt_token_ids=started.prompt_token_ids)


async def resume(request: Request) -> Response:
    """POST /v1/strata/resume: the rest of a stream, under the first one's id."""
    instance = instance_of(request)
    body = await parse_body(request, ResumeRequest)
    check_model(instance.config, body.version)
    req = admitted(request, instance, _client_request(body), task="generate")
    await hold_adapter(request, req)
    session_id = sess.session_id_of(request, json.dumps(body.request).encode())
    turn = None
    if session_id is not None and isinstance(req, ChatCompletionRequest):
        turn = await _resumed_turn(instance, request, req, session_id, body.session_revision)
    try:
        started = await unless_cancelled(request, _start(instance.serving, body, req))
    except BaseException:
        if turn is not None:
            turn.release()
        raise
    frames = _frames(instance.serving, started, req)
    if turn is None:
        return SSEResponse(request, frames, started.generation.close)
    return turn.stream_response(request, frames, started.generation)


def _client_request(body: ResumeRequest) -> ClientRequest:
    """The client's request that the stream answered (the preamble admits it as it admitted the
    first one: tenant, priority, model, task)."""
    req: ClientRequest
    if body.path.endswith("chat/completions"):
        req = ChatCompletionRequest.model_validate(body.request)
    else:
        req = CompletionRequest.model_validate(body.request)
    if not req.stream or req.n != 1:
        raise InvalidRequestError("only a stream of one choice is resumed", param="n")
    return req


def _frames(ctx: ServingContext, started: Started,
            req: ClientRequest) -> AsyncGenerator[bytes, None]:
    if isinstance(req, ChatCompletionRequest):
        return serving.chat_stream(ctx, started, req.logprobs, req.include_usage, Marks())
    return serving.completion_stream(ctx, started, req.logprobs is not None, req.include_usage,
                                     Marks())


async def _start(ctx: ServingContext, body: ResumeRequest, req: ClientRequest) -> Started:
    tr.check_common_limits(req, ctx.config)
    prompt, sent = body.prompt_token_ids, body.output_token_ids
    tools, (constraint,) = await plan_choices(ctx.grammar, req, 1)  # advanced past `sent`
    if isinstance(req, ChatCompletionRequest):
        params = serving.chat_params(ctx, req, len(prompt), 0, constraint)
    else:
        params = serving.completion_params(ctx, req, len(prompt), 0, constraint)
    num_public = tr.public_prefix_tokens(req, prompt, ctx.tokenizer) \
        if isinstance(req, ChatCompletionRequest) else 0
    request = tr.engine_request(tr.new_id("resume"), prompt, params, req, ctx.tokenizer,
                                ctx.clock(), num_public, loras=ctx.config.loras)
    request.output_token_ids = list(sent)
    # the model's vocabulary, not the tokenizer's: a model may have more rows than its tokenizer
    # has tokens (padding), and the first instance may have sent any of them (as empty text)
    vocab = ctx.engine.engine.vocab_size or ctx.tokenizer.vocab_size
    if not all(0 <= t < vocab for t in request.all_token_ids):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="output_token_ids")
    if body.finish is None:
        released = released_text(ctx.tokenizer, request)  # before the engine adds tokens
        generation = await start(ctx.engine, [request], [0], ctx.metrics, ctx.clock,
                                 ctx.kv_offload)
        generation.choices[0].text_parts.insert(0, released)
    else:
        generation = _finished(ctx, request, body.finish)
    echo = ctx.tokenizer.decode(prompt) if isinstance(req, CompletionRequest) and req.echo else ""
    offset = len(echo) + sum(len(ctx.tokenizer.id_to_token_text(t)) for t in sent)
    return Started(body.id, req.model or ctx.config.served_model_name, generation, [""],
                   body.created, prompt, is_resumed=True, offsets=[offset], tools=tools)


def _finished(ctx: ServingContext, request: EngineRequest, finish: ResumeFinish) -> Generation:
    """A stream that broke after its last token: nothing to generate, the answer replayed."""
    by_token = finish.reason == "stop" and not isinstance(finish.stop_reason, str)
    text = final_text(ctx.tokenizer, request, stopped_by_token=by_token)
    choice = ChoiceState(0, 0, text_parts=[text], finish_reason=finish.reason,
                         stop_reason=finish.stop_reason,
                         num_prompt_tokens=request.num_prompt_tokens,
                         num_output_tokens=request.num_output_tokens)
    return Generation([choice], [], [])


async def _resumed_turn(instance: Instance, request: Request, req: ChatCompletionRequest,
                        session_id: str, revision: int | None) -> ResumedTurn:
    """The session turn of the broken stream, locked; its history is already in the prompt."""
    sessions = instance.require_sessions()
    if revision is None or revision < 1:
        raise InvalidRequestError("a session's stream is resumed with the revision its first "
                                  "answer announced", param="session_revision")
    tenant = sess.tenant_of(request)
    await sessions.locks.acquire((tenant, session_id))
    return ResumedTurn(sessions, session_id, tenant, revision - 1, tr.chat_messages(req.messages),
                       req, 0)


class ResumedTurn(sess.SessionTurn):
    """A session turn finished by a resumed stream: stored once (see the module docstring)."""

    __slots__ = ()

    async def commit(self, choices: Sequence[ChoiceState]) -> bool:
        try:
            return await sess.SessionTurn.commit(self, choices)
        except SessionConflictError:
            if not await self._stored_before(choices):
                raise
            return True

    async def _stored_before(self, choices: Sequence[ChoiceState]) -> bool:
        record = await self.sessions.store.get(self.session_id, tenant=self.tenant)
        mine = [*self.new_messages, {"role": "assistant", "content": choices[0].text}]
        if record is None or record.revision != self.base_revision + 1:
            return False
        if list(record.messages[-len(mine):]) != mine:
            return False
        self.stored_revision = record.revision
        return True


def resume_routes() -> list[APIRoute]:
    return [APIRoute(RESUME_PATH, resume, methods=["POST"])]


__all__ = ["ResumedTurn", "marks_for", "resume", "resume_routes"]
