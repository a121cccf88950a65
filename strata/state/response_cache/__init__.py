"""The response cache: finished answers to deterministic requests, by key (contract: base.py).

    create_response_cache("memory://")                 one gateway (memory.py; LRU)
    create_response_cache("sqlite:///abs/path.db")     gateways on one machine (sqlite.py)
    create_response_cache("redis://127.0.0.1:6379/0")  gateways on many machines (redis.py)
"""

from __future__ import annotations

import time

from strata.errors import ResponseCacheError
from strata.state.response_cache.base import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    DEFAULT_MAX_ENTRY_BYTES,
    DEFAULT_TTL_S,
    Clock,
    EntryLimits,
    ResponseCache,
    ResponseCacheOptions,
)
from strata.state.response_cache.memory import MemoryResponseCache  # built directly by tests
from strata.state.response_cache.sqlite import SqliteResponseCache
from strata.state.urls import backend_module


def create_response_cache(url: str, *, ttl_s: float = DEFAULT_TTL_S,
                          max_bytes: int = DEFAULT_MAX_BYTES,
                          max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
                          max_entries: int = DEFAULT_MAX_ENTRIES,
                          clock: Clock = time.time) -> ResponseCache:
    """The backend named by `url`'s scheme (strata/state/urls.py); the options are
    ResponseCacheOptions'."""
    options = ResponseCacheOptions(ttl_s=ttl_s, max_bytes=max_bytes,
                                   max_entry_bytes=max_entry_bytes, max_entries=max_entries,
                                   clock=clock)
    cache: ResponseCache = backend_module("response_cache", url).from_url(url, options)
    return cache


__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_ENTRIES", "DEFAULT_MAX_ENTRY_BYTES", "DEFAULT_TTL_S",
           "EntryLimits", "MemoryResponseCache", "ResponseCache", "ResponseCacheError",
           "ResponseCacheOptions", "SqliteResponseCache", "create_response_cache"]
