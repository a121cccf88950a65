"""The registry: where instances announce themselves and routers find them (`create_registry`),
and the control plane's models, versions, routing pointers, deployments and releases
(`create_model_registry`, strata/registry/models.py). One URL names both:

    create_registry("memory://")                 one process (tests)
    create_registry("sqlite:///abs/path.db")     one machine, many processes (`strata up`)
    create_registry("redis://127.0.0.1:6379/0")  many machines
"""

from __future__ import annotations

import time
from collections.abc import Callable

from strata.errors import ConfigError, RegistryError
from strata.registry.base import Registry
from strata.registry.memory import MemoryRegistry
from strata.registry.model_registry import create_model_registry
from strata.registry.records import InstanceLoad, InstanceRecord, InstanceState, Role
from strata.registry.sqlite import SqliteRegistry
from strata.state.sqlite_db import sqlite_path
from strata.state.urls import scheme_of


def create_registry(url: str, *, ttl_s: float = 5.0,
                    clock: Callable[[], float] = time.time) -> Registry:
    """The registry backend named by `url`'s scheme (strata/state/urls.py); records expire
    `ttl_s` after a heartbeat."""
    backend = scheme_of("registry", url).backend
    if backend == "memory":
        return MemoryRegistry(ttl_s=ttl_s, clock=clock)
    if backend == "sqlite":
        path = sqlite_path(url, what="registry",
                           example="sqlite:///var/run/strata/registry.db")
        return SqliteRegistry(path, ttl_s=ttl_s, clock=clock)
    if backend == "redis":
        from strata.registry.redis import RedisRegistry  # lazy: redis is only needed here

        return RedisRegistry(url, ttl_s=ttl_s, clock=clock)
    raise ConfigError(f"strata/state/urls.py names a {backend} registry that does not exist")


__all__ = ["InstanceLoad", "InstanceRecord", "InstanceState", "MemoryRegistry", "Registry",
           "RegistryError", "Role", "SqliteRegistry", "create_model_registry", "create_registry"]
