"""`strata sessions list|show ID|delete ID`: the caller's chat sessions, over HTTP.

Talks to `/v1/sessions` of an instance or of a gateway that proxies it; the API key (from
`--api-key`, else the first of STRATA_API_KEYS) decides whose sessions these are.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from strata.commands.env import CliEnv
from strata.errors import StrataError

COLUMNS = ("SESSION", "REVISION", "MESSAGES", "MODEL", "VERSION", "UPDATED")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `strata sessions {list,show,delete} [--url URL] [--api-key KEY] [--json]`."""
    p = sub.add_parser("sessions", help="list, show or delete chat sessions")
    ssub = p.add_subparsers(dest="sessions_command", required=True,
                            metavar="{list,show,delete}")
    listing = ssub.add_parser("list", help="your sessions, most recently updated first")
    listing.add_argument("--limit", type=int, default=100)
    ssub.add_parser("show", help="one session's history").add_argument("session_id")
    ssub.add_parser("delete", help="remove one session").add_argument("session_id")
    for command in ssub.choices.values():
        command.add_argument("--url", default="http://127.0.0.1:8000",
                             help="gateway or instance base URL (default http://127.0.0.1:8000)")
        command.add_argument("--api-key", default=None,
                             help="API key (default: the first of STRATA_API_KEYS)")
        command.add_argument("--json", action="store_true", help="print the raw JSON")


def run(args: argparse.Namespace, env: CliEnv) -> int:
    """Print the answer; a refused request raises StrataError (exit 1, message on stderr)."""
    key = args.api_key or (env.api_keys[0] if env.api_keys else None)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=30.0) as client:
        if args.sessions_command == "list":
            body = _call(client, "GET", "/v1/sessions", params={"limit": args.limit})
            print(_dumps(body) if args.json else format_table(body["data"], now=time.time()))
        elif args.sessions_command == "show":
            body = _call(client, "GET", f"/v1/sessions/{args.session_id}")
            print(_dumps(body) if args.json else format_session(body))
        else:
            _call(client, "DELETE", f"/v1/sessions/{args.session_id}")
            print(f"deleted session {args.session_id}")
    return 0


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> Any:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise StrataError(f"cannot reach {client.base_url}: {exc}; check --url") from None
    if response.status_code >= 400:
        raise StrataError(f"{method} {path}: {response.status_code} {_error(response)}")
    return response.json() if response.content else None


def _error(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _dumps(body: Any) -> str:
    return json.dumps(body, indent=2, ensure_ascii=False)


def format_table(sessions: Sequence[dict[str, Any]], *, now: float) -> str:
    """Aligned columns, one line per session; a note when there is none."""
    if not sessions:
        return "no sessions"
    rows = [COLUMNS, *((str(s["id"]), str(s["revision"]), str(s["num_messages"]), s["model"],
                        s["version"], f"{max(0.0, now - s['updated_at']):.0f}s ago")
                       for s in sessions)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def format_session(body: dict[str, Any]) -> str:
    """A header line, then one `role: content` line per message."""
    head = (f"session {body['id']}  revision {body['revision']}  model {body['model']}@"
            f"{body['version']}  {len(body['messages'])} messages")
    return "\n".join([head, *(f"{m.get('role')}: {m.get('content')}" for m in body["messages"])])


__all__ = ["add_parser", "format_session", "format_table", "run"]
