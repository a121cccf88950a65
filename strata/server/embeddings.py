"""POST /v1/embeddings: inputs -> pooling requests -> one vector each (an embed instance only).

The path, in order:
  1. the instance's door (preamble.py): parse (strata/protocol/embeddings.py checks `input`),
     priority clamp, admission (draining, dead, another model), the embed task
  2. `dimensions`: the full size, or for a Matryoshka model a size it allows (EmbedConfig)
  3. texts are tokenized with [CLS] ... [SEP]; token ids go as given; each input must fit the
     model's positions and vocabulary (a 400 that names `input` and the limit)
  4. every input becomes a pooling request (strata/engine/request.py): the engine's scheduler
     batches them with other requests' inputs, and each finishes with its embedding (metrics.py
     counts it and its latency as it does a completion's)
  5. truncate + renormalize to `dimensions`, encode as float lists or base64, count the usage
A generate instance answers this route with a 400; an embed instance refuses generation
(generation_routes.py).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.engine.outputs import RequestOutput
from strata.engine.request import FinishReason, SamplingParams
from strata.engine.request import Request as EngineRequest
from strata.errors import ContextLengthError, InvalidRequestError, RequestFailedError
from strata.protocol.embeddings import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    encode_vector,
    inputs_of,
)
from strata.server.instance import Instance
from strata.server.metrics import track
from strata.server.preamble import client_request
from strata.server.request_io import unless_cancelled
from strata.server.serving import ServingContext
from strata.server.translate import new_id
from strata.types import RequestId


async def embeddings(request: Request) -> Response:
    instance, req = await client_request(request, EmbeddingRequest, task="embed")
    dimensions = _dimensions(instance, req.dimensions)
    prompts = _prompts(instance, req)
    vectors = await unless_cancelled(
        request, _embed(instance.serving, prompts, req.priority))
    data = [Embedding(index=i, embedding=encode_vector(_truncated(v, dimensions),
                                                       req.encoding_format))
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(p) for p in prompts)
    body = EmbeddingResponse(data=data, model=instance.config.served_model_name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                  total_tokens=num_tokens))
    return JSONResponse(body.model_dump())


def _dimensions(instance: Instance, dimensions: int | None) -> int | None:
    embed = instance.config.embed
    if dimensions is None or embed is None or dimensions == embed.num_dimensions:
        return None
    if not embed.is_matryoshka:
        raise InvalidRequestError(
            f"dimensions: `{instance.config.served_model_name}` has no Matryoshka training, so "
            f"its embeddings cannot be shortened; leave dimensions out (or send "
            f"{embed.num_dimensions})", param="dimensions")
    if not embed.allows(dimensions):
        sizes = embed.matryoshka_dimensions or f"1 .. {embed.num_dimensions}"
        raise InvalidRequestError(f"dimensions must be one of {sizes}, got {dimensions}",
                                  param="dimensions")
    return dimensions


def _prompts(instance: Instance, req: EmbeddingRequest) -> list[list[int]]:
    inputs = inputs_of(req.input)
    tokenizer = instance.tokenizer
    prompts = [tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else x
               for x in inputs]
    max_len, vocab = instance.engine.max_model_len, tokenizer.vocab_size
    for i, prompt in enumerate(prompts):
        if len(prompt) > max_len:
            raise ContextLengthError(
                f"input[{i}] has {len(prompt)} tokens, but this model's maximum input length "
                f"is {max_len} tokens; shorten it or split it", param="input")
        if any(t >= vocab for t in prompt):
            raise InvalidRequestError(f"input[{i}]: token ids must be in [0, {vocab})",
                                      param="input")
    return prompts


async def _embed(ctx: ServingContext, prompts: list[list[int]],
                 priority: int) -> list[list[float]]:
    """Queue one pooling request per prompt (validated synchronously), await every vector."""
    base, now = new_id("embd"), ctx.clock()
    streams: list[AsyncGenerator[RequestOutput, None]] = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(track(ctx.engine.generate(EngineRequest(
                request_id=RequestId(f"{base}-{i}"), prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=1), arrival_time=now,
                priority=priority, is_pooling=True)), ctx.metrics, now, ctx.clock))
        return list(await asyncio.gather(*(_vector(s) for s in streams)))
    finally:
        for stream in streams:  # aborts what is unfinished (a cancelled or failed request)
            await stream.aclose()


async def _vector(stream: AsyncGenerator[RequestOutput, None]) -> list[float]:
    async for output in stream:
        if output.finished and output.finish_reason != FinishReason.ERROR \
                and output.embedding is not None:
            return output.embedding
        if output.finished:
            break
    raise RequestFailedError("the model failed on this input; the other inputs were fine")


def _truncated(vector: list[float], dimensions: int | None) -> list[float]:
    """The first `dimensions` values, renormalized (Matryoshka); all of them when None."""
    if dimensions is None:
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


def embedding_routes() -> list[APIRoute]:
    return [APIRoute("/v1/embeddings", embeddings, methods=["POST"])]


__all__ = ["embedding_routes"]
