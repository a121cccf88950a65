"""The hand-off routes of every instance (strata/protocol/pd.py draws the exchange):

    POST   /internal/prefill/v1/chat/completions, /internal/prefill/v1/completions   P
    POST   /internal/decode/v1/chat/completions, /internal/decode/v1/completions     D
    GET    /internal/kv/layout                                                       P
    GET    /internal/kv/{handle}   DELETE /internal/kv/{handle}                      P
    GET    /internal/kv/{handle}/shm (blocks by reference, a D on P's host)          P

They sit behind the same middleware as the OpenAI routes and take only the fleet's internal key
(strata/protocol/auth.py): the gateway and the other instances call them, never a client. The
client's identity comes with the gateway's call (strata/protocol/keys.py).
"""

from __future__ import annotations

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from strata.protocol.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)
from strata.protocol.openapi import Operation
from strata.protocol.pd import DECODE_PREFIX, KV_PATH, LAYOUT_PATH, PREFILL_PREFIX
from strata.server import serving
from strata.server.pd.decode import decode_chat, decode_completion
from strata.server.pd.prefill import ack, layout, prefill, pull
from strata.server.pd.shm_pull import pull_shm


async def prefill_chat(request: Request) -> Response:
    return await prefill(request, ChatCompletionRequest, serving.start_chat)


async def prefill_completion(request: Request) -> Response:
    return await prefill(request, CompletionRequest, serving.start_completion)


PD_OPERATIONS: tuple[Operation, ...] = (  # held to the routes by the OpenAPI test
    Operation("POST", f"{PREFILL_PREFIX}/v1/chat/completions",
              "Hand-off: prefill a chat prompt, hold its blocks, answer a handle",
              ChatCompletionRequest, access="internal"),
    Operation("POST", f"{PREFILL_PREFIX}/v1/completions",
              "Hand-off: prefill a prompt, hold its blocks, answer a handle", CompletionRequest,
              access="internal"),
    Operation("POST", f"{DECODE_PREFIX}/v1/chat/completions",
              "Hand-off: a chat completion whose prompt is pulled (X-Strata-Handoff)",
              ChatCompletionRequest, ChatCompletionResponse, streams=True, access="internal"),
    Operation("POST", f"{DECODE_PREFIX}/v1/completions",
              "Hand-off: a completion whose prompt is pulled (X-Strata-Handoff)",
              CompletionRequest, CompletionResponse, streams=True, access="internal"),
    Operation("GET", LAYOUT_PATH, "Hand-off handshake: what this instance's KV bytes mean",
              access="internal"),
    Operation("GET", KV_PATH + "/{handle}", "Hand-off pull: the held blocks, a binary stream",
              query=(("start", "integer"), ("count", "integer")),
              media_type="application/octet-stream", access="internal"),
    Operation("GET", KV_PATH + "/{handle}/shm",
              "Hand-off pull by reference: the held blocks put in the shared-memory pool, "
              "where, a line of JSON a batch", query=(("start", "integer"), ("count", "integer")),
              media_type="application/x-ndjson", access="internal"),
    Operation("DELETE", KV_PATH + "/{handle}", "Hand-off acknowledgement: free the blocks",
              status=204, access="internal"),
)


def pd_routes() -> list[APIRoute]:
    return [
        APIRoute(f"{PREFILL_PREFIX}/v1/chat/completions", prefill_chat, methods=["POST"]),
        APIRoute(f"{PREFILL_PREFIX}/v1/completions", prefill_completion, methods=["POST"]),
        APIRoute(f"{DECODE_PREFIX}/v1/chat/completions", decode_chat, methods=["POST"]),
        APIRoute(f"{DECODE_PREFIX}/v1/completions", decode_completion, methods=["POST"]),
        APIRoute(LAYOUT_PATH, layout, methods=["GET"]),
        APIRoute(KV_PATH + "/{handle}", pull, methods=["GET"]),
        APIRoute(KV_PATH + "/{handle}/shm", pull_shm, methods=["GET"]),
        APIRoute(KV_PATH + "/{handle}", ack, methods=["DELETE"]),
    ]


__all__ = ["PD_OPERATIONS", "pd_routes"]
