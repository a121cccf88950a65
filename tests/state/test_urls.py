"""The store URL table (strata/state/urls.py) against the code: every backend it names is a
module with `from_url` and every backend module is in it; every factory's error and every
`--help` text lists the table's forms; a store whose URL is not Redis never imports redis."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import strata.state
from strata.cli import build_parser
from strata.errors import ConfigError
from strata.registry import create_model_registry, create_registry
from strata.state.kv_store import create_kv_store
from strata.state.pins import create_pin_store
from strata.state.response_cache import create_response_cache
from strata.state.sessions import create_session_store
from strata.state.urls import STORES, scheme_of, schemes_help, schemes_of
from strata.state.usage import create_usage_store

STATE_STORES = ("sessions", "pins", "kv_store", "response_cache", "usage")
SENTINEL_FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
EVERY_FORM = ("memory://, sqlite:///PATH, redis://HOST:PORT/DB, rediss://HOST:PORT/DB, "
              + SENTINEL_FORM)
FACTORIES: dict[str, Callable[[str], Any]] = {
    "sessions": create_session_store, "pins": create_pin_store, "kv_store": create_kv_store,
    "response_cache": create_response_cache, "registry": create_registry,
    "model_registry": create_model_registry, "usage": create_usage_store,
}


@pytest.mark.parametrize("store", STATE_STORES)
def test_each_store_package_has_a_module_per_backend_of_the_table(store: str) -> None:
    package = Path(strata.state.__file__).parent / store
    # not backends: the protocol, and the write-behind that wraps any backend of sessions
    modules = {path.stem for path in package.glob("*.py")} - {"__init__", "base", "write_behind"}
    assert modules == {scheme.backend for scheme in schemes_of(store)}
    for backend in sorted(modules):
        assert callable(importlib.import_module(f"strata.state.{store}.{backend}").from_url)


def test_each_store_lists_the_forms_of_its_backends() -> None:
    assert schemes_help("kv_store") == ("memory://, redis://HOST:PORT/DB, "
                                        "rediss://HOST:PORT/DB, " + SENTINEL_FORM)
    for store in ("sessions", "pins", "response_cache", "usage", "registry", "model_registry"):
        assert schemes_help(store) == EVERY_FORM
    assert set(FACTORIES) == set(STORES)


@pytest.mark.parametrize("store", sorted(FACTORIES))
def test_every_factory_refuses_an_unknown_url_listing_its_forms(store: str) -> None:
    with pytest.raises(ConfigError) as refused:
        FACTORIES[store]("etcd://127.0.0.1:2379")
    assert str(refused.value) == (f"unknown {STORES[store]} URL 'etcd://127.0.0.1:2379'; "
                                  f"use one of: {schemes_help(store)}")


def test_a_url_matches_its_scheme_and_memory_takes_no_address() -> None:
    assert [scheme_of("pins", url).backend for url in (
        "memory://", "memory", "sqlite:////tmp/p.db", "redis://h:1/0", "rediss://h:1/0",
    )] == ["memory", "memory", "sqlite", "redis", "redis"]
    with pytest.raises(ConfigError, match="unknown pin store URL 'memory://x'"):
        scheme_of("pins", "memory://x")
    with pytest.raises(ConfigError, match="unknown KV store URL 'sqlite:///k.db'; use one of: "
                                          "memory://, redis://"):
        scheme_of("kv_store", "sqlite:///k.db")
    with pytest.raises(ConfigError, match="unknown store 'cache'; use one of: sessions, pins"):
        schemes_help("cache")


def flag_help(command: str, flag: str) -> str:
    commands = next(action for action in build_parser()._actions
                    if isinstance(action, argparse._SubParsersAction))
    return next(str(action.help) for action in commands.choices[command]._actions
                if flag in action.option_strings)


@pytest.mark.parametrize(("command", "flag", "store"), [
    ("serve", "--registry", "registry"), ("serve", "--session-store", "sessions"),
    ("serve", "--kv-store", "kv_store"), ("gateway", "--registry", "registry"),
    ("gateway", "--session-store", "pins"), ("gateway", "--version-pin-store", "pins"),
    ("gateway", "--response-cache", "response_cache"), ("gateway", "--usage-store", "usage"),
])
def test_help_lists_the_forms_of_the_store_a_flag_names(command: str, flag: str,
                                                         store: str) -> None:
    assert schemes_help(store) in flag_help(command, flag)


def test_stores_on_memory_and_sqlite_never_import_redis(tmp_path: Path) -> None:
    code = f"""
import sys
from strata.registry import create_model_registry, create_registry
from strata.state.kv_store import create_kv_store
from strata.state.pins import create_pin_store
from strata.state.response_cache import create_response_cache
from strata.state.sessions import create_session_store
for factory in (create_session_store, create_pin_store, create_response_cache, create_registry,
                create_model_registry):
    factory("sqlite:///{tmp_path}/" + factory.__name__ + ".db")
    factory("memory://")
create_kv_store("memory://")
print(sorted(name for name in sys.modules if name.split(".")[0] == "redis"))
create_kv_store("redis://127.0.0.1:1/0")
print("redis" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "True"]
