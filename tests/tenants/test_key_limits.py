"""The key file's rpm=/tpm= fields (strata/protocol/budgets.py) as `strata gateway` reads them:
beside a key and its priority ceiling, from the file and STRATA_API_KEYS; every bad value is a
ConfigError that names the field and what to write, never the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from live_fleet import gateway_config

from strata.cli import cli_env_from
from strata.errors import ConfigError
from strata.gateway.config import GatewayConfig, TenantConfig
from strata.protocol.budgets import KeyLimits
from strata.types import PriorityClass

SECRET = "sk-secret-0123"


def config_of(tmp_path: Path, *lines: str, env: dict[str, str] | None = None) -> GatewayConfig:
    keys = tmp_path / "client.keys"
    keys.write_text("\n".join(lines) + "\n")
    return gateway_config(["--instances", "http://127.0.0.1:9", "--api-key-file", str(keys)],
                          cli_env_from({"STRATA_CACHE_DIR": str(tmp_path), **(env or {})}))


def test_limits_sit_beside_the_key_and_its_ceiling(tmp_path: Path) -> None:
    config = config_of(tmp_path, "# tenants", "k-plain", "k-capped:batch rpm=10 tpm=5000",
                       "k-tokens   tpm=300", "k-tokens tpm=200 rpm=9",
                       env={"STRATA_API_KEYS": "k-env:interactive rpm=4,k-plain"})
    assert config.api_keys == ("k-plain", "k-capped", "k-tokens", "k-env")
    assert dict(config.key_max_priority) == {
        "k-capped": int(PriorityClass.BATCH), "k-env": int(PriorityClass.INTERACTIVE)}
    assert dict(config.tenants.key_limits) == {
        "k-capped": KeyLimits(requests_per_min=10, tokens_per_min=5000),
        "k-tokens": KeyLimits(requests_per_min=9, tokens_per_min=200),  # the lower of each
        "k-env": KeyLimits(requests_per_min=4)}


@pytest.mark.parametrize(("line", "message"), [
    (f"{SECRET} rpm=abc", "an API key's rpm must be a positive integer, got 'abc'; write "
                          "KEY[:MAX_PRIORITY] [rpm=N] [tpm=N]"),
    (f"{SECRET} tpm=0", "an API key's tpm must be a positive integer, got 0"),
    (f"{SECRET}:batch tpm=-5", "an API key's tpm must be a positive integer, got -5"),
    (f"{SECRET} tpm=1.5", "an API key's tpm must be a positive integer, got '1.5'"),
    (f"{SECRET} burst=3", "an API key's limit 'burst=3' is not rpm=N or tpm=N"),
    (f"{SECRET} rpm", "an API key's limit 'rpm' is not rpm=N or tpm=N"),
    (f"{SECRET} rpm=1 rpm=2", "an API key's rpm is given twice"),
])
def test_a_bad_limit_is_a_config_error_naming_the_field_not_the_key(
        tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_of(tmp_path, line)
    assert str(refused.value).startswith(message)
    assert SECRET not in str(refused.value)
    with pytest.raises(ConfigError) as from_env:
        cli_env_from({"STRATA_API_KEYS": line})
    assert str(from_env.value).startswith(message)


def test_the_usage_store_is_one_of_its_forms(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown usage store URL 'etcd://u'; use one "
                                          "of: memory://, sqlite:///PATH, redis://"):
        gateway_config(["--instances", "http://127.0.0.1:9", "--usage-store", "etcd://u"])


def test_limits_only_go_beside_client_keys() -> None:
    with pytest.raises(ConfigError, match="1 key.s. with rpm=/tpm= limits are not client keys"):
        GatewayConfig(api_keys=("a",), tenants=TenantConfig(
            key_limits=((SECRET, KeyLimits(requests_per_min=1)),)))
