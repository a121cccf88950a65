"""The session pin table: which instance a session sticks to (contract: base.py).

    create_pin_store("memory://")                 one gateway (memory.py; tests)
    create_pin_store("sqlite:///abs/path.db")     gateways on one machine (sqlite.py; table
                                                  `session_pins`)
    create_pin_store("redis://127.0.0.1:6379/0")  gateways on many machines (redis.py; keys
                                                  `strata:pins:*`)
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.errors import PinStoreError
from strata.state.pins.base import PinStore, PinStoreOptions
from strata.state.pins.memory import MemoryPinStore  # built directly by tests and one gateway
from strata.state.pins.sqlite import SqlitePinStore
from strata.state.urls import backend_module


def create_pin_store(url: str, *, ttl_s: float = 3600.0, clock: Clock = time.time,
                     namespace: str = "pins") -> PinStore:
    """The pin store named by `url`'s scheme (strata/state/urls.py); the options are
    PinStoreOptions'."""
    options = PinStoreOptions(ttl_s=ttl_s, clock=clock, namespace=namespace)
    store: PinStore = backend_module("pins", url).from_url(url, options)
    return store


__all__ = ["MemoryPinStore", "PinStore", "PinStoreError", "PinStoreOptions", "SqlitePinStore",
           "create_pin_store"]
