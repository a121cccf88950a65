"""A simulated instance's LoRA adapter slots: `--max-cpu-loras` as a cost model, for fleets on a
virtual clock (bench/lora_placement.py) that place adapters with the gateway's own policies.

It keeps the rules of the real table (strata/server/loras.py): at most `num_slots` adapters
resident; a request holds its adapter until it ends; a load evicts the least recently used
adapter nobody holds, and waits while every resident one is held; loads run one at a time, each
taking `load_s`. It does no I/O and reads no clock: the caller says when.

    start(name, now)   -> when the adapter is ready for the request (now when resident), or
                          None when every slot is held (try again after a `release`)
    release(name)      the request holding `name` ended
    residency()        what the instance's load report would carry (protocol/lora.py)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from strata.errors import ConfigError
from strata.protocol.lora import AdapterResidency


@dataclass(slots=True)
class AdapterSlots:
    """One instance's resident adapters (see the module docstring)."""

    num_slots: int
    load_s: float
    known: tuple[str, ...] = ()  # every adapter it can load (for its residency report)
    num_loads: int = 0
    num_evictions: int = 0
    _recent: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU first
    _held: dict[str, int] = field(default_factory=dict)
    _loads_of: dict[str, int] = field(default_factory=dict)
    _evictions_of: dict[str, int] = field(default_factory=dict)
    _loader_free_at: float = 0.0

    def __post_init__(self) -> None:
        if self.num_slots <= 0:
            raise ConfigError(f"num_slots must be positive, got {self.num_slots}")
        if self.load_s < 0:
            raise ConfigError(f"load_s must be >= 0, got {self.load_s}")

    def is_resident(self, name: str) -> bool:
        return name in self._recent

    def start(self, name: str, now: float) -> float | None:
        """Hold `name` for a request arriving `now`: when it is ready (None: no slot free)."""
        ready_at = now
        if name not in self._recent:
            if len(self._recent) >= self.num_slots and not self._evict():
                return None
            ready_at = max(now, self._loader_free_at) + self.load_s
            self._loader_free_at = ready_at
            self.num_loads += 1
            self._loads_of[name] = self._loads_of.get(name, 0) + 1
        self._recent[name] = None
        self._recent.move_to_end(name)
        self._held[name] = self._held.get(name, 0) + 1
        return ready_at

    def release(self, name: str) -> None:
        left = self._held.get(name, 0) - 1
        if left > 0:
            self._held[name] = left
        else:
            self._held.pop(name, None)

    def _evict(self) -> bool:
        for victim in self._recent:
            if victim not in self._held:
                del self._recent[victim]
                self.num_evictions += 1
                self._evictions_of[victim] = self._evictions_of.get(victim, 0) + 1
                return True
        return False

    def residency(self) -> tuple[AdapterResidency, ...]:
        """Every known adapter: resident ones with a digest (their name: a simulation)."""
        return tuple(AdapterResidency(name, name if name in self._recent else None,
                                      self._loads_of.get(name, 0),
                                      self._evictions_of.get(name, 0),
                                      self.load_s if name in self._loads_of else 0.0)
                     for name in self.known)


__all__ = ["AdapterSlots"]
