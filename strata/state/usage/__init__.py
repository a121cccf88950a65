"""Tenants' usage and token-budget windows, shared by gateways (contract: base.py).

    create_usage_store("memory://")                 one gateway (memory.py; tests)
    create_usage_store("sqlite:///PATH")            gateways on one machine (sqlite.py)
    create_usage_store("redis://127.0.0.1:6379/0")  gateways on many machines (redis.py; keys
                                                    `strata:usage:*`)
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.errors import UsageStoreError
from strata.state.urls import backend_module
from strata.state.usage.base import (
    Counts,
    UsageKey,
    UsageStore,
    UsageStoreOptions,
    Window,
)
from strata.state.usage.memory import MemoryUsageStore


def create_usage_store(url: str, *, retention_s: float = 86400.0,
                       clock: Clock = time.time) -> UsageStore:
    """The usage store named by `url`'s scheme (strata/state/urls.py)."""
    options = UsageStoreOptions(retention_s=retention_s, clock=clock)
    store: UsageStore = backend_module("usage", url).from_url(url, options)
    return store


__all__ = ["Counts", "MemoryUsageStore", "UsageKey", "UsageStore", "UsageStoreError",
           "UsageStoreOptions", "Window", "create_usage_store"]
