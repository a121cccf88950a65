"""OpenAI wire models of POST /v1/embeddings (pydantic v2), and the check of its `input`.

`input` is a string, a list of strings, a list of token ids or a list of lists of token ids, as
OpenAI's; anything else (an empty list or string, mixed lists, booleans, floats) is a 400 that
names `input`. `encoding_format` is "float" (lists of floats) or "base64" (the little-endian
float32 bytes of each vector, base64-encoded, as OpenAI's clients decode them). vLLM's pooling
extras that Strata does not implement (`truncate_prompt_tokens`, `normalize`, `embed_dtype`,
chat `messages`) are refused by name, never ignored.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from strata.errors import InvalidRequestError

EmbeddingInput = list[str] | list[list[int]]  # after `inputs_of`: all texts or all token ids
UNSUPPORTED = ("truncate_prompt_tokens", "normalize", "embed_dtype", "messages")


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    input: Any = None  # checked by `inputs_of`, for messages that name the field
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    priority: Any = None  # a class name or an integer, as a completion's (protocol/priority.py)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: object) -> object:
        if isinstance(data, dict):
            name = next((n for n in UNSUPPORTED if data.get(n) is not None), None)
            if name is not None:
                raise ValueError(f"{name} is not supported by Strata's embeddings; remove it")
        return data


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def inputs_of(value: Any) -> EmbeddingInput:
    """The request's inputs as a list of texts or a list of token-id lists; else a 400."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _bad("must be a non-empty string, list of strings, list of token ids or list of "
                   "lists of token ids")
    if all(isinstance(v, str) for v in value):
        if not all(value):
            raise _bad("must not contain an empty string")
        return value
    if all(_is_token_id(v) for v in value):
        return [value]
    if all(isinstance(v, list) and v and all(_is_token_id(t) for t in v) for v in value):
        return value
    raise _bad("must be a string, a list of strings, a list of token ids (non-negative "
               "integers) or a list of non-empty lists of token ids, not a mix")


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"input {message}", param="input")


__all__ = ["Embedding", "EmbeddingRequest", "EmbeddingResponse", "EmbeddingUsage",
           "encode_vector", "inputs_of"]
