"""The one priority API (strata/protocol/priority.py): class names or integers, higher = more
important, the header before the body, clamped to the API key's ceiling."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from strata.cli import cli_env_from
from strata.commands.env import read_api_keys, read_key_max_priority
from strata.errors import InvalidRequestError
from strata.protocol.auth import ApiKeyAuth
from strata.protocol.priority import (
    MAX_PRIORITY_STATE,
    effective_priority,
    key_ceilings,
    parse_priority,
    split_key_spec,
)
from strata.types import PriorityClass


def test_class_names_and_integers_share_one_scale() -> None:
    assert [parse_priority(v) for v in ("interactive", " Standard ", "batch", "sheddable")] \
        == [10, 0, -10, -20]
    assert [parse_priority(v) for v in (7, "-3", None)] == [7, -3, None]
    assert [PriorityClass.of(p).label for p in (25, 10, 9, 0, -1, -10, -11)] == [
        "interactive", "interactive", "standard", "standard", "batch", "batch", "sheddable"]


@pytest.mark.parametrize("bad", ["urgent", True, 1.5, 100_000, [], "1e3"])
def test_anything_else_is_a_400_that_lists_the_classes(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match="interactive, standard, batch, sheddable"):
        parse_priority(bad)


def test_the_header_wins_then_the_body_then_standard_and_the_ceiling_clamps() -> None:
    assert effective_priority("interactive", "batch", None) == 10
    assert effective_priority(None, "batch", None) == -10
    assert effective_priority("", None, None) == 0
    assert effective_priority("interactive", None, -10) == -10
    assert effective_priority(None, "sheddable", -10) == -20  # a ceiling never raises


def test_key_specs_carry_a_ceiling() -> None:
    assert split_key_spec("sk-1:batch") == ("sk-1", -10)
    assert split_key_spec("sk-2:5") == ("sk-2", 5)
    assert split_key_spec("sk:with:colons") == ("sk:with:colons", None)
    assert split_key_spec("plain") == ("plain", None)
    assert key_ceilings(["a:batch", "b", "a:sheddable"]) == (("a", "b"), {"a": -20})


def test_keys_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nk-file:batch\nk-open\n")
    env = cli_env_from({"STRATA_API_KEYS": "k-env:interactive, k-open2",
                        "STRATA_CACHE_DIR": str(tmp_path)})
    assert env.api_keys == ("k-env", "k-open2")
    assert read_api_keys(path, env.api_keys) == ("k-file", "k-open", "k-env", "k-open2")
    assert read_key_max_priority(path, env) == (("k-env", 10), ("k-file", -10))


def test_the_auth_middleware_hands_the_ceiling_to_the_route() -> None:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"max": request.scope.get("state", {}).get(MAX_PRIORITY_STATE)})

    app = ApiKeyAuth(Starlette(routes=[Route("/x", echo)]), keys=["a", "b"],
                     max_priority={"a": -10})

    async def story() -> list[object]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [(await client.get("/x", headers={"authorization": f"Bearer {k}"})).json()
                    for k in ("a", "b")]

    got = asyncio.run(story())
    assert got == [{"max": -10}, {"max": None}]
