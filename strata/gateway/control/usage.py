"""GET /admin/usage?since=...[&tenant=...]: what each tenant used, per model, summed over every
gateway that shares this one's usage store (strata/state/usage/), from the minute `since` falls
in until now.

`since` is epoch seconds (`1733400000`), an ISO 8601 time (`2026-12-05T18:00:00Z`; without a
zone, UTC) or an age (`90s`, `15m`, `2h`, `1d`); absent, the last hour. Anything else, or a time
in the future, is a 400 with the OpenAI error body. Rows come most tokens first:

    {"object": "list", "since": 1733400000, "until": 1733403600.2,
     "data": [{"tenant": "9f86d081...", "model": "sim", "requests": 12, "errors": 0,
               "rate_limited": 1, "prompt_tokens": 340, "cached_tokens": 128,
               "completion_tokens": 96, "total_tokens": 436}, ...]}

A tenant is the sha256 prefix its key names (strata/protocol/keys.tenant_of_key), "public"
without client keys; usage older than --usage-retention-s is gone.
"""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.errors import InvalidRequestError
from strata.gateway.upstream.pools import error_response
from strata.gateway.wiring import Gateway
from strata.state.usage.base import WINDOW_S, minute_of

DEFAULT_AGE_S = 3600.0
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str | None, now_s: float) -> float:
    """The epoch seconds `since` names (see the module docstring); InvalidRequestError else."""
    if text is None:
        return now_s - DEFAULT_AGE_S
    since = _parse(text.strip(), now_s)
    if since is None:
        raise InvalidRequestError(
            f"since: expected epoch seconds, an ISO 8601 time or an age such as 15m, got "
            f"{text!r}", param="since")
    if since > now_s:
        raise InvalidRequestError(f"since: {text!r} is in the future", param="since")
    return since


def _parse(text: str, now_s: float) -> float | None:
    age = _AGE.match(text)
    if age:
        return now_s - float(age.group(1)) * _UNIT_S[age.group(2)]
    try:
        return float(text) if text.replace(".", "", 1).isdigit() else _iso(text)
    except ValueError:
        return None


def _iso(text: str) -> float:
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


async def usage(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    store = gateway.usage
    if store is None:
        return error_response(404, "this gateway keeps no usage")
    now_s = time.time()
    try:
        since = parse_since(request.query_params.get("since"), now_s)
    except InvalidRequestError as exc:
        return error_response(400, str(exc))
    tenant = request.query_params.get("tenant")
    totals = await store.totals(since)
    rows: list[dict[str, Any]] = [
        {"tenant": key[0], "model": key[1], **counts.as_dict()}
        for key, counts in totals.items() if tenant is None or key[0] == tenant]
    rows.sort(key=lambda row: (-row["total_tokens"], -row["requests"], row["tenant"],
                               row["model"]))
    return JSONResponse({"object": "list", "since": minute_of(since) * WINDOW_S,
                         "until": now_s, "data": rows})


__all__ = ["DEFAULT_AGE_S", "parse_since", "usage"]
