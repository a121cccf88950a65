"""Grammar libraries compared on this CPU for Strata's structured output: xgrammar, llguidance and
outlines-core over the default model's tokenizer (SmolLM2, 49,152 tokens).

Needs the three libraries (only llguidance is a Strata dependency):
    .venv/bin/pip install xgrammar outlines-core

Usage (JSON on stdout, a table on stderr):
    .venv/bin/python bench/grammar_libs.py [--model PATH] [--repeat 5]

Measured for each library:
- `tokenizer_ms`: building its tokenizer/vocabulary object once per model.
- `compile_ms`: compiling each grammar (a JSON schema of 5 properties with a nested object, an
  enum, an array and a pattern; `json_object`; a regex), cold (no cache).
- `first_mask_us`: the first mask of a fresh matcher (lazy libraries build their lexer here).
- `mask_us`: computing the next-token bitmask (int32 words, 1 bit per token) at each later step
  of a valid answer's tokens, then advancing by that token: mean, p50 and p99 per token over the
  answer (the same token sequence for every library). `advance_us`: the advance alone.
- `validity`: answers drawn uniformly at random from each mask (EOS taken half the time it is
  allowed) over five schemas (bounded strings, a pattern, numbers, enums), per schema
  "valid/finished/drawn": finished within 400 tokens, parsed (`json.loads`) and validated
  (`jsonschema`), with one invalid answer when there was one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.fetch import resolve_model  # noqa: E402
from strata.model.gguf_loader import open_gguf  # noqa: E402
from strata.sim.tokenizer import byte_alphabet  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "tags", "address", "status"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
          "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
          "status": "active"}
REGEX = r"(\+?1 )?\(?[0-9]{3}\)?[ -]?[0-9]{3}-[0-9]{4}"
ANSWER_TEXT = json.dumps(ANSWER, separators=(", ", ": "))
# Validity: answers drawn uniformly from each mask must parse and validate.
def _bounded(schema: Any) -> Any:
    """`schema` with maxLength 10 on every string without one (uniform draws end strings only
    where a bound forces them to)."""
    if isinstance(schema, list):
        return [_bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded(v) for k, v in schema.items()}
    if out.get("type") == "string" and "pattern" not in out:
        out.setdefault("maxLength", 10)
    return out


VALIDITY_SCHEMAS: list[dict[str, Any]] = [
    _bounded(SCHEMA),
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6},
                                      "t": {"type": "string", "minLength": 2, "maxLength": 4}},
     "required": ["s", "t"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "x": {"type": "number"}, "b": {"type": "boolean"},
                                      "z": {"type": "null"}},
     "required": ["n", "x", "b", "z"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                      "note": {"type": "string", "maxLength": 10}},
     "required": ["code", "note"], "additionalProperties": False},
]
Mask = np.ndarray


Matcher = tuple[Callable[[], Any], Callable[[int], Any]]  # fill the mask; advance by a token


class Lib:
    """One library: its tokenizer view, compile a grammar, a matcher over the shared mask."""

    name = ""

    def compile(self, kind: str, source: str) -> Any: ...

    def matcher(self, compiled: Any, mask: Mask) -> Matcher: ...


class Xgrammar(Lib):
    name = "xgrammar"

    def __init__(self, raw_vocab: list[str], special: set[int], eos: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab = ["" if i in special else t for i, t in enumerate(raw_vocab)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab),
                                 stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, source: str) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(source, any_whitespace=False)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        return self.compiler.compile_regex(source)

    def matcher(self, compiled: Any, mask: Mask) -> Matcher:
        m = self.xgr.GrammarMatcher(compiled)
        return (lambda: m.fill_next_token_bitmask(mask, 0)), m.accept_token


class Llguidance(Lib):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import llguidance

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)

    def compile(self, kind: str, source: str) -> Any:
        m = self.ll.LLMatcher
        if kind in ("json_schema", "json_object"):
            grammar = m.grammar_from_json_schema(
                source if kind == "json_schema" else '{"type": "object"}',
                defaults={"whitespace_flexible": False, "item_separator": ", ",
                          "key_separator": ": "})
        else:
            grammar = m.grammar_from_regex(source)
        matcher = m(self.tokenizer, grammar)  # llguidance compiles lazily: count the first use
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled: Any, mask: Mask) -> Matcher:
        from llguidance.numpy import fill_next_token_bitmask

        m = self.ll.LLMatcher(self.tokenizer, compiled)
        return (lambda: fill_next_token_bitmask(m, mask, 0)), m.consume_token


class OutlinesCore(Lib):
    name = "outlines-core"

    def __init__(self, raw_vocab: list[str], special: set[int], eos: int) -> None:
        import outlines_core as oc

        self.oc = oc
        decode = {c: b for b, c in enumerate(byte_alphabet())}
        tokens: dict[bytes, list[int]] = {}
        for i, t in enumerate(raw_vocab):
            if i not in special and i != eos:
                tokens.setdefault(bytes(decode[c] for c in t), []).append(i)
        self.vocabulary = oc.Vocabulary(eos, tokens)

    def compile(self, kind: str, source: str) -> Any:
        if kind in ("json_schema", "json_object"):
            regex = self.oc.json_schema.build_regex_from_schema(
                source if kind == "json_schema" else '{"type": "object"}',
                whitespace_pattern=" ?")
        else:
            regex = source
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any, mask: Mask) -> Matcher:
        guide = self.oc.Guide(compiled)
        ptr, numel = mask.ctypes.data, mask.shape[1]
        return ((lambda: guide.write_mask_into(ptr, numel, 4)),
                lambda t: guide.advance(t, return_tokens=False))


def _allowed(mask: Mask, token: int) -> bool:
    return bool((int(mask[0, token // 32]) & 0xFFFFFFFF) >> (token % 32) & 1)


def _walk(matcher: Matcher, tokens: list[int], mask: Mask) -> tuple[list[float], list[float]]:
    """Time the mask and the advance at each token of a known valid answer."""
    fill, advance = matcher
    fill_us, advance_us = [], []
    for t in tokens:
        start = time.perf_counter_ns()
        fill()
        fill_us.append((time.perf_counter_ns() - start) / 1e3)
        if not _allowed(mask, t):
            raise AssertionError(f"token {t} refused by the mask")
        if t == tokens[-1]:
            break  # the final EOS: allowed is all that matters (outlines-core has no state after)
        start = time.perf_counter_ns()
        ok = advance(t)
        advance_us.append((time.perf_counter_ns() - start) / 1e3)
        if ok is False:
            raise AssertionError(f"token {t} refused on advance")
    return fill_us, advance_us


def _random_answer(matcher: Matcher, mask: Mask, eos: int, rng: random.Random,
                   max_steps: int = 400) -> list[int] | None:
    """Draw uniformly among the allowed tokens until EOS (None if it runs past max_steps):
    the harshest test of a mask, visiting tokens a real model would rarely pick."""
    fill, advance = matcher
    out: list[int] = []
    for _ in range(max_steps):
        fill()
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits)
        if len(allowed) == 0:
            return None
        token = eos if eos in allowed and rng.random() < 0.5 else int(rng.choice(allowed))
        if token == eos:
            return out
        advance(token)
        out.append(token)
    return None


def _summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(values), 1),
            "p50": round(ordered[len(ordered) // 2], 1),
            "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1)}


def _validity(lib: Lib, mask: Mask, eos: int, tok: Any, walks: int) -> list[str]:
    """Random answers over VALIDITY_SCHEMAS, per schema "valid/finished/answers" (or
    "refused"), and one invalid answer of each schema that had some."""
    import jsonschema

    out = []
    rng = random.Random(0)
    for schema in VALIDITY_SCHEMAS:
        try:
            compiled = lib.compile("json_schema", json.dumps(schema))
        except Exception:  # noqa: BLE001 -- a schema the library cannot compile
            out.append("refused")
            continue
        finished = valid = 0
        bad = ""
        for _ in range(walks):
            tokens = _random_answer(lib.matcher(compiled, mask), mask, eos, rng)
            if tokens is None:
                continue
            finished += 1
            text = tok.decode(tokens)
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                bad = text
        out.append(f"{valid}/{finished}/{walks}" + (f" e.g. {bad!r}" if bad else ""))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--walks", type=int, default=20, help="random answers per validity schema")
    args = ap.parse_args()
    path = resolve_model(args.model, cache_dir=Path.home() / ".cache/strata", progress=False)
    header = open_gguf(Path(path))
    tok = header.tokenizer
    tk_json = json.loads(tok.to_json())
    vocab_map = tk_json["model"]["vocab"]
    raw = [""] * header.config.vocab_size
    for t, i in vocab_map.items():
        raw[i] = t
    special = {a["id"] for a in tk_json["added_tokens"] if a.get("special")}
    for a in tk_json["added_tokens"]:
        raw[a["id"]] = a["content"]
    eos = tok.eos_token_ids[0]
    cases = {"json_schema": (json.dumps(SCHEMA), ANSWER_TEXT),
             "json_object": ("", ANSWER_TEXT),
             "regex": (REGEX, "+1 (425) 555-0123")}
    mask = np.zeros((1, (len(raw) + 31) // 32), dtype=np.int32)
    import llguidance  # noqa: F401 -- imports are not part of the tokenizer build times
    import outlines_core  # noqa: F401
    import xgrammar  # noqa: F401

    builders: list[tuple[str, Callable[[], Lib]]] = [
        ("xgrammar", lambda: Xgrammar(raw, special, eos)),
        ("llguidance", lambda: Llguidance(tok.to_json(), eos)),
        ("outlines-core", lambda: OutlinesCore(raw, special, eos)),
    ]
    report: dict[str, Any] = {"vocab_size": len(raw), "answer_tokens": {}}
    for name, build in builders:
        start = time.perf_counter()
        lib = build()
        entry: dict[str, Any] = {"tokenizer_ms": round((time.perf_counter() - start) * 1e3, 1)}
        for case, (source, text) in cases.items():
            tokens = tok.encode(text) + [eos]
            report["answer_tokens"][case] = len(tokens)
            compile_ms, firsts, fills, advances = [], [], [], []
            for _ in range(args.repeat):
                start = time.perf_counter()
                compiled = lib.compile(case, source)
                compile_ms.append((time.perf_counter() - start) * 1e3)
                f, a = _walk(lib.matcher(compiled, mask), tokens, mask)
                firsts.append(f[0])
                fills += f[1:]
                advances += a
            entry[case] = {"compile_ms": round(statistics.median(compile_ms), 1),
                           "first_mask_us": round(statistics.median(firsts), 1),
                           "mask_us": _summary(fills), "advance_us": _summary(advances)}
        entry["validity"] = _validity(lib, mask, eos, tok, args.walks)
        report[name] = entry
        for i, v in enumerate(entry["validity"]):
            print(f"{name:14s} validity schema {i}: {v[:120]}", file=sys.stderr)
        print(f"{name:14s} tokenizer {entry['tokenizer_ms']:8.1f} ms", file=sys.stderr)
        for case in cases:
            e = entry[case]
            print(f"  {case:12s} compile {e['compile_ms']:8.1f} ms  first mask "
                  f"{e['first_mask_us']:8.1f} us  then mean "
                  f"{e['mask_us']['mean']:7.1f} p50 {e['mask_us']['p50']:7.1f} p99 "
                  f"{e['mask_us']['p99']:7.1f} us  advance {e['advance_us']['mean']:6.1f} us",
                  file=sys.stderr)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
