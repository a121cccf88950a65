"""The tracing flags of `strata gateway` and `strata serve`: a bad value is refused with a message
that says what to change, before anything is started."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from strata import tracing
from strata.cli import main
from strata.commands import up
from strata.commands.env import CliEnv
from strata.errors import ConfigError

GATEWAY = ["gateway", "--instances", "http://127.0.0.1:9"]


@pytest.mark.parametrize("command", [GATEWAY, ["serve", "--simulate", "smollm2-cpu"]],
                         ids=["gateway", "serve"])
def test_a_sample_ratio_without_an_endpoint_is_an_error(
        command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--trace-sample-ratio", "0.5"]) == 1
    assert "--trace-sample-ratio needs --otlp-endpoint" in capsys.readouterr().err
    assert not tracing.is_on()


def test_an_endpoint_that_is_not_an_http_url_is_an_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*GATEWAY, "--otlp-endpoint", "collector:4318"]) == 1
    err = capsys.readouterr().err
    assert "--otlp-endpoint must be an http:// or https:// URL" in err and "collector:4318" in err
    assert not tracing.is_on()


@pytest.mark.parametrize("value", ["1.5", "-0.1", "half"])
def test_a_sample_ratio_outside_0_1_is_a_usage_error(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*GATEWAY, "--otlp-endpoint", "http://127.0.0.1:4318",
              "--trace-sample-ratio", value])
    assert exited.value.code == 2
    assert f"'{value}' is not a ratio in [0, 1]" in capsys.readouterr().err


def test_the_config_adds_the_traces_path_and_checks_the_ratio() -> None:
    config = tracing.TracingConfig("http://127.0.0.1:4318/")
    assert config.is_on and config.sample_ratio == 1.0
    assert config.traces_url == "http://127.0.0.1:4318/v1/traces"
    assert tracing.TracingConfig("https://otel.example/custom").traces_url == \
        "https://otel.example/custom"
    assert not tracing.TracingConfig().is_on
    with pytest.raises(ConfigError, match=r"--trace-sample-ratio must be in \[0, 1\], got 2"):
        tracing.TracingConfig("http://127.0.0.1:4318", sample_ratio=2.0)


def test_strata_up_passes_the_flags_to_its_gateway_and_every_instance(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="strata")
    up.add_parser(parser.add_subparsers(dest="command"))
    flags = ["--otlp-endpoint", "http://127.0.0.1:4318", "--trace-sample-ratio", "0.25"]
    args = parser.parse_args(["up", "--simulate", "smollm2-cpu", *flags])
    config = up._config(args, CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run"))
    for argv in (config.serve_args, config.gateway_args):
        at = argv.index("--otlp-endpoint")
        assert list(argv[at:at + 4]) == flags
    plain = up._config(parser.parse_args(["up", "--simulate", "smollm2-cpu"]),
                       CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run"))
    assert "--otlp-endpoint" not in (*plain.serve_args, *plain.gateway_args)
