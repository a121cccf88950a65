"""Hostile request bodies: valid OpenAI requests mutated as a careless or hostile client would.

`Mutator(seed).mutants(n)` yields `n` bodies, each one valid request (SEEDS; MODEL_SEEDS adds
structured output, tools, logit bias and embeddings for a real model) with one mutation:

    wrong_type      a field (top level or nested) gets a value of another JSON type
    extreme_number  a field gets 2**63, -2**63-1, 10**30, 1e308, a 5000-digit integer, 1e999,
                    NaN, Infinity, -0.0, 5e-324 ...
    odd_unicode     a string becomes an unpaired surrogate, NUL, a BOM, a right-to-left
                    override, combining marks, emoji, 20,000 characters, or invalid UTF-8 bytes
    missing_field   a field is removed (a required one included)
    unknown_field   an unknown field is added
    deep_nesting    a field becomes arrays or objects nested 20 to 5,000 levels deep
    truncated       the JSON text is cut anywhere
    not_an_object   the body is an array, a string, a number, null, empty, or duplicate keys

Deterministic for a seed, so a finding is reproduced by its index.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

SEEDS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "MODEL", "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "seed": 7,
        "stream": False, "stop": ["\n\n"], "n": 1, "logprobs": True, "top_logprobs": 2,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
    },
    "/v1/completions": {
        "model": "MODEL", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": 1,
        "stop_token_ids": [2], "presence_penalty": 0.5,
    },
    "/tokenize": {"model": "MODEL", "prompt": "hello world"},
    "/detokenize": {"model": "MODEL", "tokens": [1, 2, 3]},
}
# What only a real model answers: structured output and tools through the chat template, logit
# bias on the real vocabulary, embeddings from an embed instance (EMBED_MODEL).
MODEL_SEEDS: dict[str, dict[str, Any]] = {
    **SEEDS,
    "/v1/chat/completions#json_schema": {
        "model": "MODEL", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Give a number."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "answer", "strict": True, "schema": {
                "type": "object", "properties": {"n": {"type": "integer"},
                                                 "tags": {"type": "array",
                                                          "items": {"type": "string"}}},
                "required": ["n"], "additionalProperties": False}}},
    },
    "/v1/chat/completions#tools": {
        "model": "MODEL", "max_tokens": 8, "temperature": 0, "tool_choice": "required",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [{"type": "function", "function": {
            "name": "weather", "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}],
    },
    "/v1/completions#logit_bias": {
        "model": "MODEL", "prompt": "the sea", "max_tokens": 4, "temperature": 0,
        "logit_bias": {"5": 10, "7": -100, "40": 1.5},
    },
    "/v1/embeddings": {"model": "EMBED_MODEL", "input": ["hello world", "the quick fox"],
                       "encoding_format": "float"},
}
KINDS = ("wrong_type", "extreme_number", "odd_unicode", "missing_field", "unknown_field",
         "deep_nesting", "truncated", "not_an_object")
OTHER_TYPES: list[Any] = [None, True, False, 0, -1, 1.5, "", "x", [], [1, "a"], {}, {"a": 1}]
EXTREME_NUMBERS = ["9223372036854775808", "18446744073709551616", "-9223372036854775809",
                   "1000000000000000000000000000000", "1e308", "-1e308", "5e-324", "-0.0",
                   "1" + "0" * 5000, "1e999", "-1e999", "NaN", "Infinity", "-Infinity", "0",
                   "-1", "2147483648", "0.000000001", "1E400"]
ODD_STRINGS = ['"\\ud800"', '"a\\udfffb"', '"\\u0000"', '"\\ufeffhi"', '"\\u202eevil"',
               '"e\\u0301\\u0301\\u0301"', json.dumps("👍🏽🧪" * 50, ensure_ascii=False),
               json.dumps("x" * 20_000), '""', '"\\\\"', '"\\u200b"']
NOT_OBJECTS = [b"", b"[]", b"[1,2]", b'"text"', b"42", b"null", b"true", b"{", b"}",
               b'{"model": "a", "model": 5}', b"\xff\xfe{}", b"\x00", b"{}" * 3]


@dataclass(frozen=True, slots=True)
class Mutant:
    index: int
    path: str
    kind: str
    body: bytes

    def describe(self) -> str:
        shown = self.body[:120] + (b"..." if len(self.body) > 120 else b"")
        return f"#{self.index} {self.kind} {self.path} {shown!r} ({len(self.body)} bytes)"


class Mutator:
    """Mutated bodies for every seed of `seeds` (SEEDS, or MODEL_SEEDS for a real model), with
    `model` set to `model_name` (`embed_model_name` for embeddings). A seed's key is its path,
    with `#name` after it where one path has several seeds."""

    def __init__(self, seed: int, model_name: str = "MODEL", *,
                 seeds: dict[str, dict[str, Any]] | None = None,
                 embed_model_name: str = "EMBED_MODEL") -> None:
        self.rng = random.Random(seed)
        self.model_name = model_name
        self.embed_model_name = embed_model_name
        self.seeds = SEEDS if seeds is None else seeds

    def mutants(self, num: int, start: int = 0) -> Iterator[Mutant]:
        for index in range(start, start + num):
            seed = self.rng.choice(sorted(self.seeds))
            kind = KINDS[index % len(KINDS)]
            yield Mutant(index, seed.split("#")[0], kind, self.mutate(seed, kind))

    def mutate(self, seed: str, kind: str) -> bytes:
        text = json.dumps(self.seeds[seed]).replace("EMBED_MODEL", self.embed_model_name)
        body = json.loads(text.replace('"MODEL"', json.dumps(self.model_name)))
        if kind == "truncated":
            text = json.dumps(body).encode()
            return text[: self.rng.randrange(len(text))]
        if kind == "not_an_object":
            return self.rng.choice(NOT_OBJECTS)
        if kind == "missing_field":
            container, key = self._slot(body)
            del container[key]
            return json.dumps(body).encode()
        if kind == "unknown_field":
            container, _ = self._slot(body)
            if isinstance(container, list):
                container.append(self.rng.choice(OTHER_TYPES))
            else:
                container[f"x_{self.rng.randrange(1000)}"] = self.rng.choice(OTHER_TYPES)
            return json.dumps(body).encode()
        container, key = self._slot(body)
        container[key] = "@@HOLE@@"
        return json.dumps(body).encode().replace(b'"@@HOLE@@"', self._replacement(kind))

    def _replacement(self, kind: str) -> bytes:
        if kind == "wrong_type":
            return json.dumps(self.rng.choice(OTHER_TYPES)).encode()
        if kind == "extreme_number":
            return self.rng.choice(EXTREME_NUMBERS).encode()
        if kind == "odd_unicode":
            if self.rng.random() < 0.15:
                return b'"\xff\xc0 invalid utf-8"'
            return self.rng.choice(ODD_STRINGS).encode()
        depth = self.rng.choice([20, 33, 100, 1000, 3000, 5000])
        opener, closer = (b"[", b"]") if self.rng.random() < 0.5 else (b'{"a":', b"}")
        return opener * depth + b"1" + closer * depth

    def _slot(self, body: dict[str, Any]) -> tuple[Any, Any]:
        """A random (container, key) anywhere in `body`: a dict key or a list index."""
        container: Any = body
        key: Any = self.rng.choice(sorted(body))
        while isinstance(container[key], dict | list) and container[key] \
                and self.rng.random() < 0.5:
            container = container[key]
            key = (self.rng.choice(sorted(container)) if isinstance(container, dict)
                   else self.rng.randrange(len(container)))
        return container, key


__all__ = ["KINDS", "MODEL_SEEDS", "SEEDS", "Mutant", "Mutator"]
