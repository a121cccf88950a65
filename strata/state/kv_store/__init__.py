"""The external KV block store: KV payloads keyed by block hash (contract: base.py).

    create_kv_store("memory://")                 one process (memory.py; tests, bench)
    create_kv_store("redis://127.0.0.1:6379/1")  every instance on one Redis (redis.py)
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.errors import KVStoreUnavailableError
from strata.state.kv_store.base import KVItem, KVStore, KVStoreLimits, KVStoreOptions
from strata.state.urls import backend_module


def create_kv_store(url: str, *, limits: KVStoreLimits | None = None,
                    clock: Clock = time.monotonic,
                    key_prefix: str = "strata:kv") -> KVStore:
    """The backend named by `url`'s scheme (strata/state/urls.py); the options are
    KVStoreOptions'."""
    options = KVStoreOptions(limits=limits or KVStoreLimits(), clock=clock, key_prefix=key_prefix)
    store: KVStore = backend_module("kv_store", url).from_url(url, options)
    return store


__all__ = ["KVItem", "KVStore", "KVStoreLimits", "KVStoreOptions", "KVStoreUnavailableError",
           "create_kv_store"]
