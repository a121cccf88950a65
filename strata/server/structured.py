"""Structured output on the instance: which grammar a request asks for, and one constraint per
choice, compiled off the event loop.

`grammar_spec` reads the request's one structured-output field (strata/protocol/extensions.py)
into a `GrammarSpec`; `GrammarService.constraints` builds the model's `Grammars` on first use
(llguidance's view of the vocabulary: about a second for 49k tokens), compiles the spec in a
worker thread (cached per spec) and gives each choice its own matcher. A simulated instance has
no logits to mask and refuses structured output.
"""

from __future__ import annotations

import asyncio
import json
import threading

from strata.engine.constraint import TokenConstraint
from strata.errors import InvalidRequestError
from strata.model.grammar import Grammars, GrammarSpec
from strata.model.tokenizer import Tokenizer
from strata.protocol.extensions import StructuredOutputFields


def grammar_spec(req: StructuredOutputFields) -> GrammarSpec | None:
    """The grammar the request asks for, or None; more than one way of asking is a 400."""
    found = [spec for spec in (_response_format(req), _structured_outputs(req), *_guided(req))
             if spec is not None]
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise InvalidRequestError(f"{names}: ask for structured output one way only",
                                  param=found[1].param)
    return found[0] if found else None


def _response_format(req: StructuredOutputFields) -> GrammarSpec | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object", param="response_format")
    assert fmt.json_schema is not None  # checked by the wire model
    return GrammarSpec("json_schema", _schema_text(fmt.json_schema.schema_), "response_format")


def _structured_outputs(req: StructuredOutputFields) -> GrammarSpec | None:
    so = req.structured_outputs
    if so is None:
        return None
    param = "structured_outputs"
    given = [GrammarSpec("json_schema", _schema_text(so.json_), param) if so.json_ is not None
             else None,
             GrammarSpec("regex", so.regex, param) if so.regex is not None else None,
             GrammarSpec.choice(so.choice, param) if so.choice is not None else None,
             GrammarSpec("grammar", so.grammar, param) if so.grammar is not None else None,
             GrammarSpec("json_object", param=param) if so.json_object else None]
    specs = [s for s in given if s is not None]
    if len(specs) != 1:
        raise InvalidRequestError("structured_outputs needs exactly one of json, regex, choice, "
                                  f"grammar, json_object (got {len(specs)})", param=param)
    return specs[0]


def _guided(req: StructuredOutputFields) -> list[GrammarSpec | None]:
    return [
        GrammarSpec("json_schema", _schema_text(req.guided_json), "guided_json")
        if req.guided_json is not None else None,
        GrammarSpec("regex", req.guided_regex, "guided_regex")
        if req.guided_regex is not None else None,
        GrammarSpec.choice(req.guided_choice, "guided_choice")
        if req.guided_choice is not None else None,
        GrammarSpec("grammar", req.guided_grammar, "guided_grammar")
        if req.guided_grammar is not None else None,
    ]


def _schema_text(schema: object) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class GrammarService:
    """The instance's grammars: built on first use, compiled in worker threads."""

    def __init__(self, tokenizer: object, vocab_size: int | None, *, simulated: bool) -> None:
        self._tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else None
        self._vocab_size = vocab_size
        self._refusal = ("a simulated instance has no logits to constrain" if simulated else
                         None if self._tokenizer is not None and vocab_size else
                         "this model's tokenizer cannot be used for structured output")
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()

    def grammars(self) -> Grammars:
        """The model's `Grammars` (built once; blocking: call it from a worker thread)."""
        with self._lock:
            if self._grammars is None:
                assert self._tokenizer is not None and self._vocab_size is not None
                self._grammars = Grammars(self._tokenizer, self._vocab_size)
            return self._grammars

    async def constraints(self, spec: GrammarSpec, n: int) -> list[TokenConstraint]:
        """One fresh constraint per choice; a grammar that cannot be built is a 400."""
        if self._refusal is not None:
            raise InvalidRequestError(f"{spec.param}: structured output is not available: "
                                      f"{self._refusal}", param=spec.param)
        grammars = await asyncio.to_thread(self.grammars)
        compiled = await asyncio.to_thread(grammars.compile, spec)
        return [grammars.constraint(compiled) for _ in range(n)]


__all__ = ["GrammarService", "grammar_spec"]
