"""The instance registry: where instances announce themselves (heartbeat, TTL) and routers find
them (contract: base.py; records: records.py).

    create_registry("memory://")                 one process (tests)
    create_registry("sqlite:///abs/path.db")     one machine, many processes (`strata up`)
    create_registry("redis://127.0.0.1:6379/0")  many machines

The backend is chosen through the stores' scheme table (strata/state/urls.py); each backend
module has `from_url(url, options)`.
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.registry.instances.base import Registry, RegistryError, RegistryOptions
from strata.registry.instances.records import (
    InstanceLoad,
    InstanceRecord,
    InstanceState,
    RankInfo,
    Role,
)
from strata.state.urls import backend_module


def create_registry(url: str, *, ttl_s: float = 5.0, clock: Clock = time.time) -> Registry:
    """The registry backend named by `url`'s scheme; records expire `ttl_s` after a
    heartbeat."""
    options = RegistryOptions(ttl_s=ttl_s, clock=clock)
    registry: Registry = backend_module("registry", url).from_url(url, options)
    return registry


__all__ = ["InstanceLoad", "InstanceRecord", "InstanceState", "RankInfo", "Registry",
           "RegistryError", "RegistryOptions", "Role", "create_registry"]
