"""The one deadline API of gateway and instance: `X-Strata-Timeout-S` or the body's `timeout`.

A request may say how many seconds its answer is still worth waiting for: the header
`X-Strata-Timeout-S` (OpenAI has no such field; the openai client keeps its `timeout` on the
client side, so a client sends it as a header through `extra_headers`), or a `timeout` field in
the body (a Strata extension, `extra_body={"timeout": 5}`). The header wins over the body, as
`X-Priority` does. The gateway starts the clock when the request enters and sends every
instance it calls (decode, a hand-off's prefill, a resume) what remains, in the header; the
instance starts its own clock from that. Past the deadline the work is aborted and the client
gets a 504 `deadline_exceeded` (a stream: an error event and [DONE]).
"""

from __future__ import annotations

import math

from strata.errors import InvalidRequestError

TIMEOUT_HEADER = "x-strata-timeout-s"
TIMEOUT_FIELD = "timeout"
MAX_TIMEOUT_S = 24 * 3600.0


def parse_timeout_s(value: object, name: str) -> float | None:
    """Seconds (a positive number, or its decimal text) -> float; None -> None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequestError(
            f"{name}: expected seconds, a number in (0, {MAX_TIMEOUT_S:.0f}], got {value!r}",
            param=name)
    return float(value)


def request_timeout_s(header: str | None, body_timeout: object) -> float | None:
    """The request's timeout in seconds: the header, else the body's field, else None."""
    if header is not None:
        return parse_timeout_s(header, TIMEOUT_HEADER)
    return parse_timeout_s(body_timeout, TIMEOUT_FIELD)


def remaining_header(deadline_s: float, now_s: float) -> tuple[str, str]:
    """The header that passes on what remains of a deadline (at least a millisecond: a
    deadline already past is the caller's to answer, never sent on)."""
    return TIMEOUT_HEADER, f"{max(deadline_s - now_s, 0.001):.3f}"


__all__ = ["MAX_TIMEOUT_S", "TIMEOUT_FIELD", "TIMEOUT_HEADER", "parse_timeout_s",
           "remaining_header", "request_timeout_s"]
