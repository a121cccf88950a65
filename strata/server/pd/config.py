"""Settings of the prefill/decode hand-off on an instance (`strata serve --pd-lease-s`,
`--pd-shm-mb`, `--fault-config`), part of `ServerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import ConfigError
from strata.server.pd.faults import FaultConfig


@dataclass(frozen=True, slots=True)
class PDConfig:
    """Hand-off settings (`strata serve --pd-lease-s`, `--fault-config`)."""

    lease_s: float = 10.0  # P holds a handle's blocks this long unless acknowledged
    broken_grace_s: float = 2.0  # ... or this long after a pull broke off (D died)
    unpulled_s: float = 2.0  # ... or this long after the grant while no pull has begun
    peer_ttl_s: float = 2.0  # D forgets a peer's layout this long after fetching it
    connect_timeout_s: float = 1.0
    pull_timeout_s: float = 30.0  # the longest silence in a pull
    shm_mb: int = 256  # the shared-memory pool a D on this host pulls from (0: none; pd/shm.py)
    faults: FaultConfig = field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        for name in ("lease_s", "broken_grace_s", "unpulled_s", "peer_ttl_s", "connect_timeout_s",
                     "pull_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.shm_mb < 0:
            raise ConfigError(f"shm_mb must be 0 (no pool) or positive, got {self.shm_mb}")


__all__ = ["PDConfig"]
