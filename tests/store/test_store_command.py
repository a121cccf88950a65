"""`strata store manifest | push | fetch` end to end against the loopback S3 server."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest
from s3_server import CountingMotoServer

from strata.commands import store as store_command
from strata.commands.env import CliEnv
from strata.store import MANIFEST_NAME, S3Config


def _run(argv: list[str], env: CliEnv) -> int:
    parser = argparse.ArgumentParser()
    store_command.add_parser(parser.add_subparsers(dest="command"))
    return store_command.run(parser.parse_args(["store", *argv]), env)


def test_manifest_push_then_fetch_prints_the_verified_path(
        tiny_dir: Path, tmp_path: Path, s3: S3Config, bucket: str,
        s3_server: CountingMotoServer, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # the CLI takes credentials from boto3's chain, here its environment variables
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    env = CliEnv(cache_dir=tmp_path / "cache", run_dir=tmp_path / "run")
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    assert _run(["manifest", str(src)], env) == 0
    assert capsys.readouterr().out == f"{src / MANIFEST_NAME}\n"
    uri = f"s3://{bucket}/team/tiny"
    common = ["--s3-endpoint-url", s3_server.url, "--no-progress"]
    assert _run(["push", str(src), uri, *common], env) == 0
    size = sum(p.stat().st_size for p in src.iterdir() if p.name != MANIFEST_NAME)
    assert capsys.readouterr().out == f"pushed 5 files ({size} bytes) to {uri}\n"
    assert _run(["fetch", uri, *common], env) == 0
    fetched = Path(capsys.readouterr().out.strip())
    assert fetched.is_relative_to(tmp_path / "cache" / "store" / bucket)
    assert (fetched / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
