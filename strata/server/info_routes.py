"""The instance's other routes: what it serves, its probes, load and drain, its tokenizer.

    GET  /v1/models          the model served and its adapters; `simulated`, `deterministic`
    GET  /health             200 while the engine thread runs (even while draining)
    GET  /ready              200 while new requests are admitted (503 draining or dead)
    GET  /metrics            Prometheus text (metrics.py)
    GET  /load               the load the registry heartbeats carry, and `draining`
    POST /admin/drain        refuse new requests; with a registration, deregister once idle
    POST /tokenize, /detokenize   the served model's tokenizer (a prompt or chat messages)
"""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.errors import EngineDeadError, InvalidRequestError
from strata.protocol.openai import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from strata.server.instance import Instance, instance_of
from strata.server.preamble import client_request
from strata.server.registration import engine_load
from strata.server.translate import chat_prompt


async def models(request: Request) -> dict[str, Any]:
    """The base model's card, then one per LoRA adapter (with its `parent`). Every generate
    card says `deterministic`: whether this instance runs one matmul kernel at every batch size
    (`strata serve --deterministic`, the default for quantized weights), so that a request's
    tokens do not depend on its batch or its cached prefix; a simulated instance says false.
    An embed card has no such field."""
    instance = instance_of(request)
    config = instance.config
    card = ModelCard(id=config.served_model_name, max_model_len=instance.engine.max_model_len,
                     owned_by="strata-simulated" if config.simulated else "strata")
    body = ModelList(data=[card]).model_dump()
    generate = {} if config.embed is not None else {"deterministic": config.deterministic}
    body["data"][0].update(task=config.task, **generate)
    if config.embed is not None:
        body["data"][0]["dimensions"] = config.embed.num_dimensions
    else:
        body["data"][0]["generation_defaults"] = config.generation_defaults.as_dict()
    if config.simulated:
        body["data"][0]["simulated"] = True
    for name in {**config.loras, **config.lora_paths}:  # resident or not
        lora = ModelCard(id=name, max_model_len=instance.engine.max_model_len).model_dump()
        body["data"].append({**lora, "parent": config.served_model_name, "task": config.task,
                             **generate})
    return body


async def health(request: Request) -> dict[str, str]:
    engine = instance_of(request).engine
    if not engine.is_healthy:
        raise EngineDeadError(engine.dead_reason or "the engine thread is not running")
    return {"status": "ok"}


async def ready(request: Request) -> dict[str, str]:
    instance_of(request).admit(None)
    return {"status": "ready"}


async def metrics(request: Request) -> Response:
    instance = instance_of(request)
    return Response(instance.metrics.render(instance.engine.stats()),
                    media_type=CONTENT_TYPE_LATEST)


async def load(request: Request) -> dict[str, Any]:
    instance = instance_of(request)
    report = engine_load(instance.engine, request.app.state.loras.residency)()
    return {**report.to_json(), "draining": instance.is_draining}


async def drain(request: Request) -> JSONResponse:
    instance = instance_of(request)
    instance.begin_drain()
    return JSONResponse({"status": "draining", "num_in_flight": instance.engine.num_in_flight},
                        status_code=202)


async def tokenize(request: Request) -> dict[str, Any]:
    instance, req = await client_request(request, TokenizeRequest, task="any")
    tokens = _tokenize(instance, req)
    return TokenizeResponse(tokens=tokens, count=len(tokens),
                            max_model_len=instance.engine.max_model_len).model_dump()


async def detokenize(request: Request) -> dict[str, Any]:
    instance, req = await client_request(request, DetokenizeRequest, task="any")
    vocab = instance.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidRequestError(f"tokens must be in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=instance.tokenizer.decode(req.tokens)).model_dump()


def _tokenize(instance: Instance, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return chat_prompt(req.messages, instance.tokenizer, req.add_generation_prompt)
    return instance.tokenizer.encode(req.prompt or "", add_special_tokens=True)


def info_routes() -> list[APIRoute]:
    return [
        APIRoute("/v1/models", models, methods=["GET"]),
        APIRoute("/health", health, methods=["GET"]),
        APIRoute("/ready", ready, methods=["GET"]),
        APIRoute("/metrics", metrics, methods=["GET"]),
        APIRoute("/load", load, methods=["GET"]),
        APIRoute("/admin/drain", drain, methods=["POST"]),
        APIRoute("/tokenize", tokenize, methods=["POST"]),
        APIRoute("/detokenize", detokenize, methods=["POST"]),
    ]


__all__ = ["info_routes"]
