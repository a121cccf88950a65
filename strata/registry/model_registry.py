"""The model registry's factory: the ModelRegistry backend named by a URL.

    create_model_registry("memory://")                 one process (tests); a fresh one per call
    create_model_registry("sqlite:///abs/path.db")     one machine, many processes (`strata up`;
                                                       may share the instance registry's file)
    create_model_registry("redis://127.0.0.1:6379/0")  many machines

The URL schemes are the instance registry's (`create_registry`, strata/state/urls.py), so one
URL names both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from strata.errors import ConfigError
from strata.registry.models import ModelRegistry
from strata.registry.models_memory import MemoryModelRegistry
from strata.registry.models_sqlite import SqliteModelRegistry
from strata.state.sqlite_db import sqlite_path
from strata.state.urls import scheme_of


def create_model_registry(url: str, *,
                          clock: Callable[[], float] = time.time) -> ModelRegistry:
    """The backend named by `url`'s scheme; `clock` stamps created_at / updated_at."""
    backend = scheme_of("model_registry", url).backend
    if backend == "memory":
        return MemoryModelRegistry(clock=clock)
    if backend == "sqlite":
        path = sqlite_path(url, what="model registry",
                           example="sqlite:///var/run/strata/registry.db")
        return SqliteModelRegistry(path, clock=clock)
    if backend == "redis":
        from strata.registry.models_redis import RedisModelRegistry  # lazy: redis only here

        return RedisModelRegistry(url, clock=clock)
    raise ConfigError(f"strata/state/urls.py names a {backend} model registry that does not exist")


__all__ = ["create_model_registry"]
