"""strata/logs.py and strata/protocol/request_id.py: the two log formats, the request id in each
record, and X-Request-Id chosen by the middleware and echoed (tests/gateway/test_request_id.py:
the gateway forwards it; tests/test_log_format_live.py: real processes)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata import logs
from strata.cli import build_parser, cli_env_from, log_config_from
from strata.commands import up
from strata.errors import ConfigError
from strata.logs import LogConfig, announce, child_flags, configure, configured
from strata.protocol.request_id import (
    RequestIdMiddleware,
    current_request_id,
    is_sane,
    set_request_id,
)

log = logging.getLogger("strata.test")


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    yield out
    logs.reset()
    set_request_id(None)


def test_json_lines_have_time_level_logger_message_and_the_request_id(
        stream: io.StringIO) -> None:
    configure(LogConfig(format="json"), stream)
    log.info("outside a request")
    set_request_id("req-42")
    log.warning("inside %s", "one")
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        log.exception("failed")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # the traceback stays inside its line
    first, second, third = (json.loads(line) for line in lines)
    assert set(first) == {"time", "level", "logger", "message"}
    assert (first["level"], first["logger"], first["message"]) == ("INFO", "strata.test",
                                                                   "outside a request")
    assert first["time"].endswith("+00:00") and "T" in first["time"]
    assert (second["message"], second["request_id"]) == ("inside one", "req-42")
    assert third["level"] == "ERROR" and third["request_id"] == "req-42"
    assert "ValueError: boom\nsecond line" in third["exc_info"]


def test_text_lines_keep_the_old_shape_with_the_request_id_in_brackets(
        stream: io.StringIO) -> None:
    configure(LogConfig(format="text", level="warning"), stream)
    log.info("below the level")
    log.warning("plain")
    set_request_id("abc")
    log.error("in a request")
    assert stream.getvalue().splitlines() == ["WARNING strata.test: plain",
                                              "ERROR strata.test: [abc] in a request"]


def test_configure_replaces_its_handler_and_reset_restores_the_root_level(
        stream: io.StringIO) -> None:
    root = logging.getLogger()
    level_before, handlers_before = root.level, list(root.handlers)
    with configured(LogConfig(format="json", level="debug")):
        configure(LogConfig(format="json", level="error"), stream)  # replaced, not added
        assert len(root.handlers) == len(handlers_before) + 1
        assert root.level == logging.ERROR
        assert logging.getLogger("httpx").level == logging.WARNING
    assert root.handlers == handlers_before and root.level == level_before
    assert logs.active() == LogConfig()


def test_a_bad_format_or_level_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="log format 'xml' is not one of text, json"):
        LogConfig(format="xml")
    with pytest.raises(ConfigError, match="log level 'loud' is not one of debug, info"):
        LogConfig(level="loud")


def test_announce_is_plain_in_text_and_a_json_record_in_json(stream: io.StringIO) -> None:
    announce("Strata serving m on http://127.0.0.1:1 (ready in 0.1s)", stream=stream)
    configure(LogConfig(format="json", level="error"), io.StringIO())
    announce("Strata gateway on http://127.0.0.1:2 (ready in 0.1s)", stream=stream)
    plain, record = stream.getvalue().splitlines()
    assert plain == "Strata serving m on http://127.0.0.1:1 (ready in 0.1s)"
    assert json.loads(record)["message"] == "Strata gateway on http://127.0.0.1:2 (ready in 0.1s)"
    assert json.loads(record)["level"] == "INFO"  # shown although the level is error
    assert child_flags() == ["--log-format", "json"]


@pytest.mark.parametrize("value,sane", [
    ("0f8fad5b-d9cb-469f-a165-70867728950e", True), ("req_1.2:3", True), ("a" * 128, True),
    ("a" * 129, False), ("", False), ("has space", False), ("-leading", False),
    ('x"}{"level":"ERROR', False), ("é", False),
])
def test_a_sane_request_id_is_short_and_plain(value: str, sane: bool) -> None:
    assert is_sane(value) is sane


def _echo_app() -> Starlette:
    async def echo(request: Request) -> Response:
        log.warning("handling")
        return JSONResponse({"seen_header": request.headers.get("x-request-id"),
                             "current": current_request_id()},
                            headers={"X-Request-Id": "the-app-said-otherwise"})

    app = Starlette(routes=[Route("/echo", echo)])
    app.add_middleware(RequestIdMiddleware)
    return app


def _get(app: Starlette, headers: dict[str, str]) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.get("/echo", headers=headers)

    return asyncio.run(run())


def test_the_middleware_keeps_a_sane_id_and_replaces_a_bad_one(stream: io.StringIO) -> None:
    configure(LogConfig(format="json"), stream)
    app = _echo_app()
    kept = _get(app, {"X-Request-Id": "client-7"})
    assert kept.json() == {"seen_header": "client-7", "current": "client-7"}
    assert kept.headers.get_list("x-request-id") == ["client-7"]  # exactly one, the chosen
    replaced = _get(app, {"X-Request-Id": "bad id"})
    new_id = replaced.headers["x-request-id"]
    assert new_id != "bad id" and is_sane(new_id) and len(new_id) == 32
    assert replaced.json() == {"seen_header": new_id, "current": new_id}
    made = _get(app, {})
    assert made.headers["x-request-id"] not in ("", new_id)
    handled = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["request_id"] for r in handled] == ["client-7", new_id,
                                                  made.headers["x-request-id"]]


def test_the_flag_beats_the_env_and_strata_up_hands_the_format_to_its_children(
        tmp_path: Path) -> None:
    env = cli_env_from({"STRATA_LOG_FORMAT": "json", "STRATA_CACHE_DIR": str(tmp_path)})
    parse = build_parser().parse_args
    assert log_config_from(parse(["gateway", "--log-level", "debug"]), env) == LogConfig(
        "json", "debug")
    assert log_config_from(parse(["models", "pull", "--log-format", "text"]), env) == LogConfig(
        "text", "info")
    args = parse(["up", "--simulate", "smollm2-cpu"])
    log_config_from(args, env)
    config = up._config(args, env)
    assert config.serve_args == ("--log-level", "warning", "--log-format", "json")
    assert config.gateway_args == ("--log-format", "json")
    text_env = cli_env_from({"STRATA_CACHE_DIR": str(tmp_path)})
    args = parse(["up", "--simulate", "smollm2-cpu"])
    log_config_from(args, text_env)
    assert up._config(args, text_env).gateway_args == ()  # text is the children's default too
