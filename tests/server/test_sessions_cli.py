"""`strata sessions list|show|delete` against a live instance with API keys."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from live_server import MODEL_NAME, LiveServer, start_server

from strata.commands import sessions
from strata.commands.env import CliEnv
from strata.errors import StrataError
from strata.model.loader import LoadedModel


@pytest.fixture(scope="module")
def server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    live = start_server(tiny_model, session_store_url="memory://", api_keys=("k1", "k2"))
    yield live
    live.stop()


def strata_sessions(argv: list[str], *, env_keys: tuple[str, ...] = ("k1",)) -> int:
    parser = argparse.ArgumentParser(prog="strata")
    sessions.add_parser(parser.add_subparsers(dest="command"))
    env = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"), api_keys=env_keys)
    return sessions.run(parser.parse_args(["sessions", *argv]), env)


def test_list_show_delete(server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    openai.OpenAI(base_url=server.v1, api_key="k1", max_retries=0).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi there"}], max_tokens=2,
        temperature=0.0, extra_body={"ignore_eos": True, "session_id": "cli-1"})
    assert strata_sessions(["list", "--url", server.base_url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["SESSION", "REVISION", "MESSAGES", "MODEL", "VERSION", "UPDATED"]
    assert table[1].split()[:5] == ["cli-1", "1", "2", MODEL_NAME, "default"]
    assert strata_sessions(["show", "cli-1", "--url", server.base_url]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("session cli-1  revision 1") and shown[1] == "user: hi there"
    assert shown[2].startswith("assistant: ")
    assert strata_sessions(["list", "--url", server.base_url, "--api-key", "k2"]) == 0
    assert capsys.readouterr().out.strip() == "no sessions"  # another tenant sees none
    assert strata_sessions(["delete", "cli-1", "--url", server.base_url]) == 0
    assert capsys.readouterr().out.strip() == "deleted session cli-1"
    with pytest.raises(StrataError, match="404 session 'cli-1' does not exist"):
        strata_sessions(["show", "cli-1", "--url", server.base_url])
