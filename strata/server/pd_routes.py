"""The hand-off routes of every instance (strata/protocol/pd.py draws the exchange):

    POST   /internal/prefill/v1/chat/completions, /internal/prefill/v1/completions   P
    POST   /internal/decode/v1/chat/completions, /internal/decode/v1/completions     D
    GET    /internal/kv/layout                                                       P
    GET    /internal/kv/{handle}   DELETE /internal/kv/{handle}                      P

They sit behind the same middleware as the OpenAI routes (API keys included).
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from strata.protocol.openai import ChatCompletionRequest, CompletionRequest
from strata.protocol.pd import DECODE_PREFIX, KV_PATH, LAYOUT_PATH, PREFILL_PREFIX
from strata.server import serving
from strata.server.pd_decode import decode_chat, decode_completion
from strata.server.pd_prefill import ack, layout, prefill, pull


async def prefill_chat(request: Request) -> Response:
    return await prefill(request, ChatCompletionRequest, serving.start_chat)


async def prefill_completion(request: Request) -> Response:
    return await prefill(request, CompletionRequest, serving.start_completion)


def pd_routes() -> list[APIRoute]:
    return [
        APIRoute(f"{PREFILL_PREFIX}/v1/chat/completions", prefill_chat, methods=["POST"]),
        APIRoute(f"{PREFILL_PREFIX}/v1/completions", prefill_completion, methods=["POST"]),
        APIRoute(f"{DECODE_PREFIX}/v1/chat/completions", decode_chat, methods=["POST"]),
        APIRoute(f"{DECODE_PREFIX}/v1/completions", decode_completion, methods=["POST"]),
        APIRoute(LAYOUT_PATH, layout, methods=["GET"]),
        APIRoute(KV_PATH + "/{handle}", pull, methods=["GET"]),
        APIRoute(KV_PATH + "/{handle}", ack, methods=["DELETE"]),
    ]


__all__ = ["pd_routes"]
