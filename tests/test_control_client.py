"""How `strata models|release|rollback` find the gateway, and what they print of a release."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from strata.commands.control import DEFAULT_GATEWAY, gateway_url, release_outcome
from strata.commands.env import CliEnv


def _env(tmp_path: Path) -> CliEnv:
    return CliEnv(cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")


def test_the_flag_wins_then_the_local_cluster_then_the_default(tmp_path: Path) -> None:
    env = _env(tmp_path)
    assert gateway_url(argparse.Namespace(gateway=None), env) == DEFAULT_GATEWAY
    env.run_dir.mkdir(parents=True)
    (env.run_dir / "cluster.json").write_text(json.dumps(
        {"gateway_url": "http://127.0.0.1:8311/", "registry_url": "sqlite:////x.db"}))
    assert gateway_url(argparse.Namespace(gateway=None), env) == "http://127.0.0.1:8311"
    remote = argparse.Namespace(gateway="http://10.0.0.7:8000/")
    assert gateway_url(remote, env) == "http://10.0.0.7:8000"
    (env.run_dir / "cluster.json").write_text("{not json")
    assert gateway_url(argparse.Namespace(gateway=None), env) == DEFAULT_GATEWAY


@pytest.mark.parametrize(("release", "code", "printed"), [
    ({"state": "done", "stats": {"ready_to_flip_s": 0.0021}}, 0, "m@v2 is live (ready -> live "
                                                                 "flip in 2 ms)"),
    ({"state": "rolled_back", "reason": "canary m@v2: error rate 30.0%"}, 1,
     "rolled_back: canary m@v2: error rate 30.0%"),
    ({"state": "warming"}, 1, "warming (still in progress; see `strata release --status`)"),
])
def test_a_release_exits_0_only_once_done(release: dict, code: int, printed: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    full = {"release_id": "m-v2-abc", "name": "m", "to_version": "v2"} | release
    assert release_outcome(full) == code
    assert printed in capsys.readouterr().out
