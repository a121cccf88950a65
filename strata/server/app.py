"""The OpenAI-compatible HTTP API over one engine. Routes only translate.

    POST /v1/completions, /v1/chat/completions   (SSE when stream=true)
    GET  /v1/models, /health, /ready, /metrics, /load
    GET  /v1/sessions, GET|DELETE /v1/sessions/{id}   (sessions.py, session_routes.py)
    POST /tokenize, /detokenize, /admin/drain

Draining (`app.state.draining`, set by `start_draining`, POST /admin/drain or the lifespan
shutdown): new requests get 503 with Retry-After while in-flight ones finish. uvicorn's graceful
shutdown waits for open connections before the lifespan shutdown stops the engine, so streams in
flight complete. With a `Registration`, the lifespan keeps the instance in the registry; a drain
reports DRAINING and deregisters once no request is in flight.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.types import Send

from strata.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
)
from strata.protocol.auth import ApiKeyAuth
from strata.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from strata.server import serving
from strata.server import sessions as sess
from strata.server.async_engine import AsyncEngine
from strata.server.body_limit import BodyLimitMiddleware, ModelVersionHeader
from strata.server.config import ServerConfig
from strata.server.errors import install_error_handlers
from strata.server.kv_offload import open_kv_offload
from strata.server.metrics import ServerMetrics
from strata.server.registration import Registration, engine_load
from strata.server.session_routes import install_session_routes, sessions_of
from strata.server.translate import ServerTokenizer, chat_prompt
from strata.state.kv_store import KVStore
from strata.state.sessions import SessionStore, create_session_store

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class _SSEResponse(StreamingResponse):
    """Streams SSE frames; whatever ends the stream (done, error, client gone) runs `on_close`."""

    def __init__(self, frames: AsyncGenerator[bytes, None],
                 on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._frames = frames
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self._frames.aclose()
            await self._on_close()


def start_draining(app: FastAPI) -> None:
    """Refuse new requests (503 + Retry-After); in-flight ones go on."""
    app.state.draining = True


def begin_drain(app: FastAPI) -> None:
    """Refuse new requests; with a registration, report DRAINING and deregister once idle."""
    start_draining(app)
    registration: Registration | None = app.state.registration
    if registration is not None and app.state.drain_task is None:
        app.state.drain_task = asyncio.create_task(
            _drain_registration(registration, _ctx(app).engine, _ctx(app).config))


async def _drain_registration(registration: Registration, engine: AsyncEngine,
                              config: ServerConfig) -> None:
    await registration.drain()
    await asyncio.sleep(config.drain_poll_s)  # lets a request admitted just before reach the engine
    while engine.num_in_flight and engine.is_healthy:
        await asyncio.sleep(config.drain_poll_s)
    await registration.stop()


def create_app(async_engine: AsyncEngine, tokenizer: ServerTokenizer, config: ServerConfig,
               *, registration: Registration | None = None,
               session_store: SessionStore | None = None,
               kv_store: KVStore | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine`; starts the engine thread.

    With `registration`, the lifespan registers the instance, heartbeats and deregisters it.
    Sessions use `session_store`, else the lifespan opens (and closes) the store named by
    `config.session_store_url`; with neither, a request with a session id is a 400.
    With `config.kv_offload`, KV blocks go to `kv_store` or the store `config.kv_store_url`
    names (kv_offload.py); the lifespan closes it."""
    async_engine.start()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = _open_sessions(app, session_store, async_engine, tokenizer, config)
        kv = _ctx(app).kv_offload = open_kv_offload(config, async_engine.engine,
                                                   app.state.metrics.kv, kv_store)
        if registration is not None:
            registration.start()
        yield
        start_draining(app)
        if registration is not None:
            await registration.drain()
        await async_engine.shutdown(config.shutdown_timeout_s)
        if app.state.drain_task is not None:  # ends now: the engine has no request left
            await app.state.drain_task
        if registration is not None:
            await registration.stop()
        if owned is not None:  # last: streams that finished during the drain stored their turn
            await owned.close()
        if kv is not None:
            await kv.close(config.shutdown_timeout_s)

    app = FastAPI(title="Strata", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.draining = False
    app.state.registration = registration
    app.state.drain_task = None
    app.state.metrics = ServerMetrics(config.served_model_name, simulated=config.simulated)
    app.state.ctx = serving.ServingContext(async_engine, tokenizer, config, app.state.metrics)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(ModelVersionHeader,
                       value=f"{config.served_model_name}@{config.model_version}")
    if config.api_keys:
        app.add_middleware(ApiKeyAuth, keys=list(config.api_keys),
                           rate_limit_per_s=config.rate_limit_per_s)
    install_error_handlers(app)
    _add_generation_routes(app)
    install_session_routes(app)
    _add_info_routes(app)
    return app


def _open_sessions(app: FastAPI, store: SessionStore | None, async_engine: AsyncEngine,
                   tokenizer: ServerTokenizer, config: ServerConfig) -> SessionStore | None:
    """Sessions over `store` or the configured URL's store; returns a store the app opened."""
    owned = None
    if store is None and config.session_store_url is not None:
        store = owned = create_session_store(
            config.session_store_url, redis_appendfsync=config.session_redis_appendfsync)
    if store is not None:
        app.state.sessions = sess.Sessions(store, config, async_engine.max_model_len, tokenizer)
    return owned


def _ctx(app: Any) -> serving.ServingContext:
    ctx: serving.ServingContext = app.state.ctx
    return ctx


async def _parse(request: Request, model: type[M]) -> M:
    """JSON body -> model; malformed JSON and wrong types raise (mapped to 400)."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return model.model_validate(data)


def _admit(request: Request, model_name: str | None) -> serving.ServingContext:
    """Refuse when draining or dead, or for another model's name."""
    ctx = _ctx(request.app)
    if request.app.state.draining:
        raise OverloadedError("the server is shutting down; retry on another instance",
                              retry_after_s=ctx.config.retry_after_s, status_code=503)
    if not ctx.engine.is_healthy:
        raise EngineDeadError(ctx.engine.dead_reason or "the engine is not running")
    _check_model(ctx.config, model_name)
    return ctx


def _check_model(config: ServerConfig, model_name: str | None) -> None:
    """`name` or `name@version` must be what this instance serves: never silently another."""
    served, version = config.served_model_name, config.model_version
    name, _, wanted = (model_name or served).partition("@")
    if name != served:
        raise ModelNotFoundError(f"The model `{model_name}` does not exist; this server serves "
                                 f"`{served}`", param="model")
    if wanted and wanted != version:
        raise ModelNotFoundError(f"Version `{wanted}` of `{served}` is not served here; this "
                                 f"instance serves `{served}@{version}`", param="model")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnect()
    finally:
        task.cancel()


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        ctx = _admit(request, req.model)
        started = await _unless_disconnected(request, serving.start_completion(ctx, req))
        with_lps = req.logprobs is not None
        if req.stream:
            frames = serving.completion_stream(ctx, started, with_lps, req.include_usage)
            return _SSEResponse(frames, started.generation.close)
        body = await _unless_disconnected(
            request, serving.completion_response(ctx, started, with_lps))
        return JSONResponse(body.model_dump())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        ctx = _admit(request, req.model)
        session_id = sess.session_id_of(request, await request.body())
        if session_id is None:
            return await _chat(request, ctx, req, None)
        turn = await sessions_of(request.app).begin(request, req, session_id)
        try:
            response = await _chat(request, ctx, turn.request, turn)
        except BaseException:
            turn.release()
            raise
        if not isinstance(response, _SSEResponse):  # a stream releases the turn when it ends
            turn.release()
        return response


async def _chat(request: Request, ctx: serving.ServingContext, req: ChatCompletionRequest,
                turn: sess.SessionTurn | None) -> Response:
    """Generate; with a session `turn`, store the turn after the last token (see sessions.py)."""
    started = await _unless_disconnected(request, serving.start_chat(ctx, req))
    if req.stream:
        frames = serving.chat_stream(ctx, started, req.logprobs, req.include_usage)
        if turn is None:
            return _SSEResponse(frames, started.generation.close)

        async def close() -> None:
            try:
                await started.generation.close()
            finally:
                turn.release()

        return _SSEResponse(turn.stream(frames, started.generation.choices), close,
                            turn.headers())
    body = await _unless_disconnected(request, serving.chat_response(ctx, started, req.logprobs))
    data = body.model_dump()
    if turn is None:
        return JSONResponse(data)
    await turn.commit(started.generation.choices)
    data["strata"] = turn.info()
    return JSONResponse(data, headers=turn.headers())


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        ctx = _ctx(request.app)
        simulated = ctx.config.simulated
        card = ModelCard(id=ctx.config.served_model_name, max_model_len=ctx.engine.max_model_len,
                         owned_by="strata-simulated" if simulated else "strata")
        body = ModelList(data=[card]).model_dump()
        if simulated:
            body["data"][0]["simulated"] = True
        return body

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        engine = _ctx(request.app).engine
        if not engine.is_healthy:
            raise EngineDeadError(engine.dead_reason or "the engine thread is not running")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> dict[str, str]:
        _admit(request, None)
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = _ctx(request.app)
        return Response(ctx.metrics.render(ctx.engine.stats()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def load(request: Request) -> dict[str, Any]:
        ctx = _ctx(request.app)
        return {**engine_load(ctx.engine)().to_json(), "draining": request.app.state.draining}

    @app.post("/admin/drain")
    async def drain(request: Request) -> JSONResponse:
        begin_drain(request.app)
        num_in_flight = _ctx(request.app).engine.num_in_flight
        return JSONResponse({"status": "draining", "num_in_flight": num_in_flight},
                            status_code=202)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, TokenizeRequest)
        ctx = _admit(request, req.model)
        tokens = _tokenize(ctx, req)
        return TokenizeResponse(tokens=tokens, count=len(tokens),
                                max_model_len=ctx.engine.max_model_len).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest)
        ctx = _admit(request, req.model)
        vocab = ctx.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise InvalidRequestError(f"tokens must be in [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens)).model_dump()


def _tokenize(ctx: serving.ServingContext, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return chat_prompt(req.messages, ctx.tokenizer, req.add_generation_prompt)
    return ctx.tokenizer.encode(req.prompt or "", add_special_tokens=True)


__all__ = ["begin_drain", "create_app", "start_draining"]
