"""What a cache-aware gateway reads from an instance (`strata gateway --policy cache_aware`):

    GET /v1/strata/kv-events?epoch=E&after=S&wait_s=W   the prefix cache's changes since a
                                                          cursor (kv_events.py), with the
                                                          tokenizer's fingerprint
    GET /v1/strata/tokenizer                              the tokenizer (tokenizer.json text),
                                                          chat template, BOS and EOS tokens

With both, the gateway renders and tokenizes a prompt exactly as this instance does and computes
the engine's own block hashes (strata/types.py), so its index and this cache name blocks alike.
The tokenizer answer is versioned by its fingerprint (sha256 of the answer's fields): a gateway
fetches it once per fingerprint, and an instance whose model version changes its tokenizer
announces another fingerprint in every kv-events answer.

An engine that is not Strata's own (a test double) or has no prefix cache answers 404 on
kv-events; a tokenizer that is not the model's (`strata.model.tokenizer.Tokenizer`) 404 on
tokenizer.
"""

from __future__ import annotations

import dataclasses

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.errors import InvalidRequestError, NotFoundError
from strata.protocol.kv_events import EVENTS_PATH, TOKENIZER_PATH
from strata.server.instance import instance_of
from strata.server.kv_events import PrefixServing


def _serving(request: Request) -> PrefixServing:
    serving = instance_of(request).prefix
    if serving is None:
        raise NotFoundError("this instance does not publish its prefix cache")
    return serving


def _query(request: Request, name: str, kind: type[float] | type[int]) -> float | int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return kind(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be a number, got {raw!r}", param=name) from None


async def kv_events(request: Request) -> JSONResponse:
    serving = _serving(request)
    if serving.feed is None:
        raise NotFoundError("this instance has no prefix cache to publish (--no-prefix-cache)")
    epoch = _query(request, "epoch", float)
    after = _query(request, "after", int)
    wait_s = _query(request, "wait_s", float) or 0.0
    answer = await serving.feed.poll(epoch, None if after is None else int(after), wait_s)
    fingerprint = serving.tokenizer.fingerprint if serving.tokenizer else None
    identity = dataclasses.replace(answer.identity, tokenizer=fingerprint)
    return JSONResponse(dataclasses.replace(answer, identity=identity).to_json())


async def tokenizer(request: Request) -> Response:
    serving = _serving(request)
    if serving.tokenizer is None:
        raise NotFoundError("this instance's tokenizer cannot be exported")
    return Response(serving.tokenizer.body, media_type="application/json")


def prefix_routes() -> list[APIRoute]:
    return [
        APIRoute(EVENTS_PATH, kv_events, methods=["GET"]),
        APIRoute(TOKENIZER_PATH, tokenizer, methods=["GET"]),
    ]


__all__ = ["prefix_routes"]
