"""The one way the instance server and the gateway read a JSON request body.

Every body that is not a JSON object they can hold is the caller's mistake, a 400 naming it,
never a 500 or a dropped connection:

    not UTF-8, not JSON, truncated          -> 400 "request body is not valid JSON: ..."
    nested deeper than MAX_JSON_DEPTH       -> 400, found by a scan before decoding (the decoder
                                               recurses, and a few thousand levels overflow it)
    NaN, Infinity, a number out of range    -> 400 (not JSON; a float that overflows to inf)
    an integer of more than 4300 digits     -> 400 (Python's int conversion limit)
    an unpaired UTF-16 surrogate (\\ud800)   -> 400 (it cannot be encoded, so never tokenized)
    valid JSON that is not an object        -> 400 "request body must be a JSON object"

MAX_JSON_DEPTH (32) is far beyond what any OpenAI request needs (a chat message's content parts
sit at depth 4) and far below what the decoder survives.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from strata.errors import InvalidRequestError

MAX_JSON_DEPTH = 32
# structure of a JSON text: escapes (skipped as a whole), quotes, brackets
_STRUCTURE = re.compile(rb'\\.|["\[\]{}]', re.DOTALL)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json_object(body: bytes, *, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """`body` as a JSON object, or InvalidRequestError (a 400) that says what is wrong."""
    check_depth(body, max_depth)
    try:
        data = _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except RecursionError:  # unreachable after check_depth; kept so it can never be a 500
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):
        _check_encodable(data)
    return data


def check_depth(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Refuse a body whose arrays and objects nest deeper than `max_depth` (strings skipped)."""
    if body.count(b"{") + body.count(b"[") <= max_depth:
        return  # no more openers than the limit, in strings or not: no scan (the common body)
    depth = 0
    in_string = False
    for match in _STRUCTURE.finditer(body):
        token = match.group()
        if token == b'"':
            in_string = not in_string
        elif in_string or len(token) == 2:
            continue
        elif token in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise _too_deep(max_depth)
        else:
            depth -= 1


def _too_deep(max_depth: int) -> InvalidRequestError:
    return InvalidRequestError(f"request body nests arrays and objects more than {max_depth} "
                               "levels deep")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


# one decoder for every body (json.loads with hooks builds a new one per call), decoding bytes
# as json.loads does (UTF-8, -16 or -32 by the first bytes)
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _check_encodable(data: Any) -> None:
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise InvalidRequestError("request body holds an unpaired UTF-16 surrogate (\\ud800-"
                                  "\\udfff without its pair); send valid Unicode") from None


__all__ = ["MAX_JSON_DEPTH", "check_depth", "parse_json_object"]
