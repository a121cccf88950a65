"""The autoscaler's controller: one decision per interval, written as desired state.

    round   take or renew the lease `autoscaler:{model}` in the registry (leases.py); without it,
            do nothing (another autoscaler leads: two can never fight); read the deployment of
            the model's live version; then for each of its pools (prefill, decode, a class's;
            an unpooled deployment is one), read that pool's signals and ask that pool's law
            (its role's capacity, its own state, dwell and bounds); write the pools that
            changed with one compare-and-set. The launchers (local supervisor, Ray) reconcile
            deployments toward it, pool by pool, and drain what they remove.
    skip    no live version or no deployment yet, or a release of the model in progress (the
            release controller owns the replicas until it is done)

Every decision is logged (changes at INFO, holds at DEBUG) and counted by pool, direction and
reason; `metrics()` exposes desired and ready replicas, the signals and the counts, per pool;
`status()` feeds the dashboard (its AutoscalerSource).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from strata.autoscale.law import HOLD, Decision, LawState, ScalingLaw, Signals
from strata.clock import Clock
from strata.errors import ConflictError, StrataError
from strata.registry import leases
from strata.registry.leases import LeaseStore
from strata.registry.models import Deployment, DeploymentState, ModelRegistry, PoolSize

log = logging.getLogger("strata.autoscale")
# (now, the deployment as one pool sees it: `pools[0]` is the pool) -> its signals
SignalReader = Callable[[float, Deployment], Signals]


@dataclass(frozen=True, slots=True)
class PoolRound:
    """What one round saw and decided for one pool (`pool.replicas`: before the decision)."""

    pool: PoolSize
    signals: Signals
    decision: Decision


@dataclass(frozen=True, slots=True)
class Round:
    """What one round saw and did."""

    at: float  # wall clock
    deployment: Deployment
    pools: tuple[PoolRound, ...]
    is_written: bool

    @property
    def signals(self) -> Signals:
        """Its first pool's (an unpooled deployment has only one)."""
        return self.pools[0].signals

    @property
    def decision(self) -> Decision:
        return self.pools[0].decision


class Autoscaler:
    """Sizes the live deployment of `model`; `run()` until cancelled (one per gateway)."""

    def __init__(self, law: ScalingLaw, models: ModelRegistry, *, model: str, owner: str,
                 read_signals: SignalReader | None = None,
                 clock: Clock = time.monotonic,
                 wall_clock: Clock = time.time) -> None:
        if not isinstance(models, LeaseStore):
            raise StrataError("the autoscaler needs a registry that keeps leases")
        self.law = law
        self.config = law.config
        self.models = models
        self.model = model
        self.owner = owner
        self.read_signals = read_signals
        self.clock = clock
        self.wall_clock = wall_clock
        self.states: dict[str, LawState] = {}  # pool label -> its law's memory
        self._laws: dict[str, ScalingLaw] = {}
        self.is_leader = False
        self.last: Round | None = None
        # (pool, direction, reason) -> count
        self.num_pool_decisions: dict[tuple[str, str, str], int] = {}
        self.skipped = ""  # why the last round did nothing ("" when it decided)

    @property
    def num_decisions(self) -> dict[tuple[str, str], int]:
        """(direction, reason) -> count, over every pool."""
        totals: dict[tuple[str, str], int] = {}
        for (_, direction, reason), count in self.num_pool_decisions.items():
            totals[(direction, reason)] = totals.get((direction, reason), 0) + count
        return totals

    @property
    def lease_name(self) -> str:
        return f"autoscaler:{self.model}"

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.round()
                except (StrataError, OSError) as exc:  # the registry is down: retry next round
                    log.warning("autoscaler round failed (%s); retrying", exc)
                await asyncio.sleep(self.config.interval_s)
        finally:
            if self.is_leader:
                await asyncio.shield(leases.release(self.models, self.lease_name, self.owner))

    async def round(self) -> Round | None:
        if not await self._lead():
            self._skip("another autoscaler holds the lease")
            return None
        deployment, why_not = await self._deployment()
        if deployment is None:
            self._skip(why_not)
            return None
        if self.read_signals is None:
            self._skip("no signals attached")
            return None
        now, pools = self.clock(), []
        for pool in deployment.pools:
            signals = self.read_signals(now, _as_one_pool(deployment, pool))
            decision = self.law_of(pool).decide(signals, self.states.setdefault(pool.label,
                                                                               LawState()))
            pools.append(PoolRound(pool, signals, decision))
        wanted = deployment.with_pool_sizes(replace(p.pool, replicas=p.decision.desired)
                                            for p in pools)
        is_written = wanted != deployment and await self._write(deployment, wanted)
        for p in pools:
            self._record(p, deployment, is_written)
        self.skipped = ""
        self.last = Round(self.wall_clock(), deployment, tuple(pools), is_written)
        return self.last

    def law_of(self, pool: PoolSize) -> ScalingLaw:
        """The law of one pool: its role's capacity, its bounds (`--pool-replicas`), the
        targets of the classes that live in it (`--class-slo`)."""
        if pool.label not in self._laws:
            low, high = self.config.bounds_of(pool.label)
            ttft_s, itl_s = self.config.slos_of(pool.pool)
            config = replace(self.config, min_replicas=low, max_replicas=high,
                             ttft_slo_s=ttft_s, itl_slo_s=itl_s)
            model = replace(self.law.model, role=pool.role)
            self._laws[pool.label] = self.law if (config, model) == (
                self.config, self.law.model) else ScalingLaw(config, model)
        return self._laws[pool.label]

    async def _lead(self) -> bool:
        lease = await leases.hold(self.models, self.lease_name, self.owner,
                                  lease_s=self.config.lease_s, now=self.wall_clock())
        if (lease is not None) != self.is_leader:
            log.info("autoscaler %s %s the lease of %s", self.owner,
                     "took" if lease is not None else "lost", self.model)
        self.is_leader = lease is not None
        return self.is_leader

    async def _deployment(self) -> tuple[Deployment | None, str]:
        routing = await self.models.get_routing(self.model)
        if routing is None or routing.live is None:
            return None, f"{self.model} has no live version"
        releases = await self.models.list_releases(self.model)
        if any(not r.is_terminal for r in releases):
            return None, f"a release of {self.model} is in progress"
        for d in await self.models.list_deployments():
            if (d.name, d.version, d.state) == (self.model, routing.live, DeploymentState.ACTIVE):
                return d, ""
        return None, f"{self.model}@{routing.live} has no active deployment"

    async def _write(self, deployment: Deployment, wanted: Deployment) -> bool:
        try:
            await self.models.put_deployment(wanted, expected_revision=deployment.revision)
        except ConflictError:  # written by someone else since we read it: next round decides
            return False
        return True

    def _record(self, p: PoolRound, deployment: Deployment, is_written: bool) -> None:
        decision, label = p.decision, p.pool.label
        key = (label, decision.direction, decision.reason)
        self.num_pool_decisions[key] = self.num_pool_decisions.get(key, 0) + 1
        if decision.direction == HOLD:
            log.debug("autoscaler: hold %s pool %s at %d (%s)", deployment.key, label,
                      p.pool.replicas, decision.reason)
            return
        log.info("autoscaler: %s %s pool %s %d -> %d (%s; needed %.2f, correction %.2f)%s",
                 decision.direction, deployment.key, label, p.pool.replicas, decision.desired,
                 decision.reason, decision.needed, decision.correction,
                 "" if is_written else " not written: the deployment changed meanwhile")

    def _skip(self, why: str) -> None:
        if why != self.skipped:
            log.info("autoscaler: %s; waiting", why)
        self.skipped = why


def _as_one_pool(deployment: Deployment, pool: PoolSize) -> Deployment:
    """The deployment as one pool's signal reader sees it: that pool alone, its replicas."""
    return deployment.with_pool_sizes([pool])


__all__ = ["Autoscaler", "PoolRound", "Round", "SignalReader"]
