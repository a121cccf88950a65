"""Passive outlier ejection and active health checks.

Invariants:
- an instance is ejected after `consecutive_failures` failures in a row (proxied attempts that got
  a connect error, a timeout or a 5xx before the first byte, or failed health checks), for
  `base_ejection_s * 2**num_ejections` seconds (capped);
- never more than `max_ejected_fraction` of the known instances are ejected at once (beyond that
  failures are counted but nobody else is ejected: better a failing instance than none);
- an ejected instance rejoins only when its ejection time is over AND a health check passes;
- a passing health check while not ejected forgives one earlier ejection (backoff decays).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import httpx

from strata.clock import Clock
from strata.gateway.config import EjectionConfig
from strata.gateway.routing.instances import DEAD, InstanceSet, InstanceView

logger = logging.getLogger("strata.gateway")


class OutlierDetector:
    """Counts failures per instance and ejects outliers (see the module docstring)."""

    def __init__(self, instances: InstanceSet, config: EjectionConfig,
                 clock: Clock = time.monotonic,
                 on_eject: Callable[[InstanceView], None] | None = None) -> None:
        self.instances = instances
        self.config = config
        self.clock = clock
        self.on_eject = on_eject

    def record_success(self, view: InstanceView) -> None:
        view.consecutive_failures = 0

    def record_failure(self, view: InstanceView) -> bool:
        """Counts one failure; True when it ejected `view`."""
        view.consecutive_failures += 1
        if view.is_ejected or view.consecutive_failures < self.config.consecutive_failures:
            return False
        if not self._may_eject_one_more():
            return False
        self._eject(view)
        return True

    def ejection_s(self, num_ejections: int) -> float:
        """How long the (num_ejections+1)-th ejection lasts."""
        return min(self.config.base_ejection_s * 2.0**num_ejections, self.config.max_ejection_s)

    def _may_eject_one_more(self) -> bool:
        views = [v for v in self.instances.snapshot() if v.state != DEAD]
        cap = math.floor(self.config.max_ejected_fraction * len(views) + 1e-9)
        return sum(v.is_ejected for v in views) + 1 <= cap

    def _eject(self, view: InstanceView) -> None:
        view.ejected_until = self.clock() + self.ejection_s(view.num_ejections)
        view.num_ejections += 1
        logger.warning("ejected instance %s until +%.1fs after %d failures", view.instance_id,
                       view.ejected_until - self.clock(), view.consecutive_failures)
        if self.on_eject is not None:
            self.on_eject(view)

    def record_health(self, view: InstanceView, is_healthy: bool) -> None:
        """Applies one active health check result."""
        view.is_healthy = is_healthy
        if is_healthy:
            view.healthy_at = self.clock()
        if not is_healthy:
            self.record_failure(view)
        elif view.is_ejected:
            if self.clock() >= view.ejected_until:
                self._rejoin(view)
        elif view.consecutive_failures == 0:
            view.num_ejections = max(0, view.num_ejections - 1)

    def _rejoin(self, view: InstanceView) -> None:
        view.ejected_until = 0.0
        view.consecutive_failures = 0
        logger.info("instance %s rejoined after a passing health check", view.instance_id)


class HealthChecker:
    """GET {url}/health on every instance, each with a timeout; results go to the detector."""

    def __init__(self, instances: InstanceSet, detector: OutlierDetector,
                 client: httpx.AsyncClient, timeout_s: float) -> None:
        self.instances = instances
        self.detector = detector
        self.client = client
        self.timeout_s = timeout_s

    async def check_once(self) -> None:
        views = [v for v in self.instances.snapshot() if v.model and v.state != DEAD]
        results = await asyncio.gather(*(self._probe(v) for v in views))
        for view, is_healthy in zip(views, results, strict=True):
            self.detector.record_health(view, is_healthy)

    async def _probe(self, view: InstanceView) -> bool:
        try:
            response = await self.client.get(f"{view.url}/health", timeout=self.timeout_s)
        except Exception:  # httpx's errors, and what a connection reset as it opens may raise
            return False
        return response.status_code == 200


__all__ = ["HealthChecker", "OutlierDetector"]
