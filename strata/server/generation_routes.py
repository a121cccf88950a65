"""The generation routes: POST /v1/completions and /v1/chat/completions (SSE when stream=true).

Each handler takes its request through the instance's one door (preamble.py: parse, tenant salt,
priority clamp, admission, task), starts the generation (serving.py) and answers with JSON or an
SSE stream. A chat request with a session id runs as a
session turn (sessions.py): the history is prepended and the answer stored.
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.protocol.openai import ChatCompletionRequest, CompletionRequest
from strata.server import serving
from strata.server import sessions as sess
from strata.server.preamble import client_request
from strata.server.request_io import SSEResponse, unless_cancelled
from strata.server.resume import marks_for


async def completions(request: Request) -> Response:
    instance, req = await client_request(request, CompletionRequest, task="generate")
    ctx = instance.serving
    started = await unless_cancelled(request, serving.start_completion(ctx, req))
    with_lps = req.logprobs is not None
    if req.stream:
        frames = serving.completion_stream(ctx, started, with_lps, req.include_usage,
                                           marks_for(request, ctx, started))
        return SSEResponse(request, frames, started.generation.close)
    body = await unless_cancelled(request, serving.completion_response(ctx, started, with_lps))
    return JSONResponse(body.model_dump())


async def chat_completions(request: Request) -> Response:
    instance, req = await client_request(request, ChatCompletionRequest, task="generate")
    session_id = sess.session_id_of(request, await request.body())
    if session_id is None:
        return await _chat(request, instance.serving, req, None)
    turn = await instance.require_sessions().begin(request, req, session_id)
    try:
        response = await _chat(request, instance.serving, turn.request, turn)
    except BaseException:
        turn.release()
        raise
    if not isinstance(response, SSEResponse):  # a stream releases the turn when it ends
        turn.release()
    return response


async def _chat(request: Request, ctx: serving.ServingContext, req: ChatCompletionRequest,
                turn: sess.SessionTurn | None) -> Response:
    """Generate; with a session `turn`, store the turn after the last token (see sessions.py)."""
    started = await unless_cancelled(request, serving.start_chat(ctx, req))
    if req.stream:
        frames = serving.chat_stream(ctx, started, req.logprobs, req.include_usage,
                                     marks_for(request, ctx, started))
        if turn is None:
            return SSEResponse(request, frames, started.generation.close)
        return turn.stream_response(request, frames, started.generation)
    body = await unless_cancelled(request, serving.chat_response(ctx, started, req.logprobs))
    data = body.model_dump()
    if turn is None:
        return JSONResponse(data)
    await turn.commit(started.generation.choices)
    data["strata"] = turn.info()
    return JSONResponse(data, headers=turn.headers())


def generation_routes() -> list[APIRoute]:
    return [
        APIRoute("/v1/completions", completions, methods=["POST"]),
        APIRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


__all__ = ["generation_routes"]
