"""The OpenAPI documents of the instance server and the gateway, from one table of operations
and the pydantic wire models of strata/protocol/openai.py.

Each side lists its routes as `Operation`s (the OpenAI ones here, shared: the gateway proxies the
instance's API; its own in server/openapi_routes.py and gateway/openapi_routes.py); a test holds
each document to its app's route table, so a route cannot go undocumented. Request bodies are
the models' validation schemas, answers their serialization schemas; every error is the one
OpenAI error body (`ErrorResponse`, the `default` response); a route that can stream says
`text/event-stream` beside its JSON. Security: an operation's `access` (strata/protocol/auth.py)
is both what its side's middleware enforces and what the document says: the schemes `client`,
`admin` and `internal` (one per kind of key) that open it, none for an open route.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from strata import __version__
from strata.protocol import embeddings
from strata.protocol import openai as wire
from strata.protocol.auth import TAKES, Access

SCHEMES = {  # kind of key -> its security scheme
    "client": {"type": "http", "scheme": "bearer", "description": "a client API key"},
    "admin": {"type": "http", "scheme": "bearer",
              "description": "an admin key (--admin-key-file)"},
    "internal": {"type": "http", "scheme": "bearer",
                 "description": "the fleet's internal key (--internal-key-file): gateways "
                                "and instances only"},
}
REF = "#/components/schemas/{model}"


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None  # the JSON body, if any
    response: type[BaseModel] | None = None  # the 2xx JSON answer (None: a JSON object)
    status: int = 200
    streams: bool = False  # may answer text/event-stream (stream: true)
    access: Access = "client"
    media_type: str = "application/json"  # of the answer
    query: tuple[tuple[str, str], ...] = ()  # (name, JSON type) of query parameters


OPENAI_OPERATIONS: tuple[Operation, ...] = (
    Operation("POST", "/v1/chat/completions", "Chat completion (SSE when stream is true)",
              wire.ChatCompletionRequest, wire.ChatCompletionResponse, streams=True),
    Operation("POST", "/v1/completions", "Text completion (SSE when stream is true)",
              wire.CompletionRequest, wire.CompletionResponse, streams=True),
    Operation("POST", "/v1/embeddings", "Embeddings (an instance of --task embed)",
              embeddings.EmbeddingRequest, embeddings.EmbeddingResponse),
    Operation("POST", "/tokenize", "Tokenize a prompt or chat messages", wire.TokenizeRequest,
              wire.TokenizeResponse),
    Operation("POST", "/detokenize", "Token ids back to text", wire.DetokenizeRequest,
              wire.DetokenizeResponse),
    Operation("GET", "/v1/models", "The models served", response=wire.ModelList),
    Operation("GET", "/v1/sessions", "The caller's sessions", query=(("limit", "integer"),)),
    Operation("GET", "/v1/sessions/{session_id}", "One session of the caller, with messages"),
    Operation("DELETE", "/v1/sessions/{session_id}", "Delete one session of the caller",
              status=204),
    Operation("GET", "/health", "200 while the process serves", access="open"),
    Operation("GET", "/ready", "200 while new requests are admitted", access="open"),
    Operation("GET", "/metrics", "Prometheus metrics", access="open", media_type="text/plain"),
)


def openapi_document(title: str, operations: Sequence[Operation]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `operations`."""
    models = {m for op in operations for m in (op.request, op.response) if m is not None}
    modes: tuple[JsonSchemaMode, ...] = ("validation", "serialization")
    keyed = sorted(((m, mode) for m in models for mode in modes),
                   key=lambda k: (k[0].__name__, k[1]))
    _, defs = models_json_schema(keyed, ref_template=REF)
    _, errors = models_json_schema([(wire.ErrorResponse, "serialization")], ref_template=REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": __version__},
        "paths": paths,
        "components": {
            "schemas": {**defs.get("$defs", {}), **errors.get("$defs", {})},
            "securitySchemes": SCHEMES,
        },
    }


def _operation(op: Operation) -> dict[str, Any]:
    error = {"description": "an OpenAI error body", "content": _json(wire.ErrorResponse)}
    out: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op),
                           "responses": {str(op.status): _answer(op), "4XX": error,
                                         "503": error, "default": error}}
    if op.status == 204:
        out["responses"]["204"] = {"description": "done"}
    params = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
              for name in re.findall(r"{(\w+)}", op.path)]
    params += [{"name": name, "in": "query", "required": False, "schema": {"type": kind}}
               for name, kind in op.query]
    if params:
        out["parameters"] = params
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": _json(op.request)}
    if op.access != "open":
        out["security"] = [{kind.value: []} for kind in sorted(TAKES[op.access],
                                                               key=lambda k: k.value)]
    return out


def _answer(op: Operation) -> dict[str, Any]:
    if op.media_type != "application/json":
        return {"description": "ok", "content": {op.media_type: {"schema": {"type": "string"}}}}
    content = _json(op.response)
    if op.streams:
        content["text/event-stream"] = {"schema": {  # each event: a chunk's JSON, [DONE]
            "type": "object", "properties": {"data": {"type": "string"}}}}
    return {"description": "ok", "content": content}


def _json(model: type[BaseModel] | None) -> dict[str, Any]:
    schema = {"$ref": REF.format(model=model.__name__)} if model else {"type": "object"}
    return {"application/json": {"schema": schema}}


def _operation_id(op: Operation) -> str:
    words = re.sub(r"[^a-zA-Z0-9]+", "_", op.path).strip("_")
    return f"{op.method.lower()}_{words or 'root'}"


__all__ = ["OPENAI_OPERATIONS", "SCHEMES", "Operation", "openapi_document"]
