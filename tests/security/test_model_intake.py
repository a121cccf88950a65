"""POST /admin/models registers only what the gateway's roots allow, with `strata serve` flags
from one table (strata/gateway/control/intake.py); and `strata up` keys itself: an internal key
per run, an admin key when client keys come without one, each a 0600 file gone at stop."""

from __future__ import annotations

import argparse
import asyncio
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from strata.cli import build_parser
from strata.commands.run_keys import RunKeys, local_admin_key
from strata.errors import ConfigError
from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.control.intake import SERVE_ARGS, check_serve_args, check_uri
from strata.gateway.routing.sources import StaticSource
from strata.registry import create_model_registry, create_registry

ROOTS = ("alias:", "sim:", "s3://models/prod/", "/srv/models")


@pytest.mark.parametrize("uri", ["smollm2", "sim:smollm2-cpu", "sim:/tmp/p.json",
                                 "s3://models/prod/llama/v2", "/srv/models/llama",
                                 "file:///srv/models/llama/", "/srv/models/a/../b"])
def test_uris_under_the_roots_are_taken(uri: str) -> None:
    check_uri(uri, ROOTS)


@pytest.mark.parametrize("uri", ["/etc", "/srv/models/../../etc/passwd", "/srv/modelsX/a",
                                 "file:///root/.ssh", "models/llama", "./llama",
                                 "s3://models/dev/llama", "s3://other/prod/x",
                                 "http://10.0.0.1/model", "hf://org/model", "//srv/models/a"])
def test_uris_outside_the_roots_are_refused_by_name(uri: str) -> None:
    with pytest.raises(ConfigError, match=f"model URI {uri!r} is not under"):
        check_uri(uri, ROOTS)


def test_the_default_roots_take_aliases_simulations_and_s3_but_no_path() -> None:
    defaults = GatewayConfig().model_roots
    for uri in ("smollm2", "sim:smollm2-cpu", "s3://any/bucket"):
        check_uri(uri, defaults)
    with pytest.raises(ConfigError, match="--model-root"):
        check_uri("/home/someone/weights", defaults)
    with pytest.raises(ConfigError, match="expected alias:"):
        GatewayConfig(model_roots=("relative/dir",))


@pytest.mark.parametrize("args", [(), ("--max-model-len", "2048"), ("--max-model-len=2048",),
                                  ("--dtype", "float32", "--no-prefix-cache"),
                                  ("--tensor-parallel-size", "2"), ("--deterministic",),
                                  ("--no-deterministic",)])
def test_serve_args_from_the_table_are_taken(args: tuple[str, ...]) -> None:
    check_serve_args(args)


@pytest.mark.parametrize(("args", "named"), [
    (("--registry", "redis://elsewhere"), "flag --registry"),
    (("--api-key-file", "/tmp/k"), "flag --api-key-file"),
    (("--host=0.0.0.0",), "flag --host"),
    (("--s3-endpoint-url", "http://attacker"), "flag --s3-endpoint-url"),
    (("--fault-config", "/tmp/f"), "flag --fault-config"),
    (("--simulate", "x"), "flag --simulate"),
    (("--insecure",), "flag --insecure"),
    (("/other/model",), "argument '/other/model'"),
    (("--max-model-len",), "--max-model-len needs a value"),
    (("--no-prefix-cache=1",), "--no-prefix-cache takes no value"),
])
def test_other_serve_args_are_refused_by_name(args: tuple[str, ...], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        check_serve_args(args)


def test_the_table_holds_flags_strata_serve_has_with_their_arity() -> None:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve = {flag: action for action in sub.choices["serve"]._actions
             for flag in action.option_strings}
    for flag, takes_value in SERVE_ARGS.items():
        assert flag in serve, flag
        assert (serve[flag].nargs != 0) is takes_value, flag


def test_the_admin_api_refuses_them_with_a_400_and_stores_nothing() -> None:
    models = create_model_registry("memory://")
    app = create_gateway_app(GatewayConfig(model_roots=ROOTS),
                             StaticSource((), httpx.AsyncClient()),
                             run_background=False, models=models,
                             instance_registry=create_registry("memory://"))

    async def post(body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gw") as client:
            return await client.post("/admin/models", json=body)

    base = {"name": "m", "version": "v2", "uri": "/srv/models/m"}
    assert asyncio.run(post(base)).status_code == 201
    for bad in ({"uri": "/etc/shadow"}, {"serve_args": ["--registry", "redis://x"]}):
        answer = asyncio.run(post(base | {"version": "v3"} | bad))
        assert answer.status_code == 400, answer.text
    assert [v.version for v in asyncio.run(models.list_versions())] == ["v2"]


def test_strata_up_makes_an_internal_key_per_run_and_an_admin_key_when_needed(
        tmp_path: Path) -> None:
    made = RunKeys.make(tmp_path, has_internal=False, has_client=True, has_admin=False)
    assert made.internal is not None and made.admin is not None
    for path in (made.internal, made.admin):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert len(path.read_text().strip()) >= 40
    assert stat.S_IMODE(made.internal.parent.stat().st_mode) == 0o700
    assert made.flags() == ["--internal-key-file", str(made.internal.resolve()),
                            "--admin-key-file", str(made.admin.resolve())]
    assert local_admin_key(tmp_path) == made.admin.read_text().strip()
    first = made.internal.read_text()
    again = RunKeys.make(tmp_path, has_internal=False, has_client=True, has_admin=False)
    assert again.internal is not None and again.internal.read_text() != first  # new each run
    again.remove()
    assert not (tmp_path / "keys" / "internal.key").exists() and local_admin_key(tmp_path) is None
    given = RunKeys.make(tmp_path, has_internal=True, has_client=False, has_admin=False)
    assert given == RunKeys() and given.flags() == []
