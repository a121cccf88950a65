"""The routing poll and the fence of `--release-consistency strict`, on a fake clock.

- Each poll re-reads the routing; a view is published when what the gateway serves changed,
  else every quarter of the lease, and only a published view renews the lease.
- Past the lease without a renewal, a strict router refuses what its view decides (live,
  canary, a session's first turn) with a 503 and Retry-After; an explicit version and a
  session's existing pin still go through. A bounded router never refuses.
- A served revision counts only once its live version is routable here; a strict router never
  falls back to `previous` (the version a flip retires), a bounded one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from gateway_fakes import view

from strata.clock import ManualClock
from strata.gateway.app import every
from strata.gateway.control.views import RoutingPoll
from strata.gateway.path.versions import VersionRouter
from strata.gateway.routing.instances import InstanceSet, ReportedLoad
from strata.protocol.lora import AdapterResidency
from strata.registry.models import ModelRegistry, ModelRouting, ModelVersion, create_model_registry
from strata.registry.models.views import RoutingView
from strata.state.pins import MemoryPinStore

LEASE_S = 2.0


async def registry(clock: ManualClock) -> ModelRegistry:
    models = create_model_registry("memory://", clock=clock)
    for version in ("v1", "v2"):
        await models.add_version(ModelVersion("m", version, f"sim:{version}"))
    await models.set_routing(ModelRouting("m", live="v1"), expected_revision=0)
    return models


class FailingBoard:
    """A view board whose writes fail (the registry went away)."""

    async def put_view(self, view: RoutingView) -> RoutingView:
        raise ConnectionError("registry unreachable")

    async def list_views(self) -> list[RoutingView]:
        raise ConnectionError("registry unreachable")


def setup(models: ModelRegistry, clock: ManualClock, *, strict: bool,
          instances: InstanceSet | None = None) -> tuple[VersionRouter, RoutingPoll]:
    instances = instances or InstanceSet([view("a", version="v1"), view("b", version="v2")])
    router = VersionRouter(models, instances, MemoryPinStore(), rng=random.Random(0),
                           lease_s=LEASE_S if strict else None, clock=clock)
    poll = RoutingPoll(router, models, gateway="gw", level="strict" if strict else "bounded",
                       lease_s=LEASE_S, clock=clock, wall=clock)
    return router, poll


def test_views_are_published_on_change_or_every_quarter_lease_and_renew_the_lease() -> None:
    async def story() -> None:
        clock = ManualClock(100.0)
        models = await registry(clock)
        router, poll = setup(models, clock, strict=True)
        assert router.is_stale  # never read: strict refuses until the first poll
        await poll.poll_once()
        (first,) = await models.list_views()
        assert (first.revisions, first.seq, first.level, first.lease_s) == (
            (("m", 1),), 1, "strict", LEASE_S)
        clock.advance(0.2)
        await poll.poll_once()  # nothing changed, heartbeat not due: not published
        assert (await models.list_views())[0].seq == 1 and router.renewed_at == 100.0
        clock.advance(0.3)
        await poll.poll_once()  # a quarter lease since the last publish
        assert (await models.list_views())[0].seq == 2 and router.renewed_at == 100.5
        routing = await models.get_routing("m")
        assert routing is not None
        await models.set_routing(routing.flipped_to("v2"), expected_revision=1)
        clock.advance(0.2)
        await poll.poll_once()  # the flip: published at once
        (flipped,) = await models.list_views()
        assert (flipped.revisions, flipped.seq, flipped.read_at) == ((("m", 2),), 3, 100.7)

    asyncio.run(story())


def test_a_strict_router_past_its_lease_refuses_only_what_its_view_decides() -> None:
    async def story() -> None:
        clock = ManualClock(100.0)
        models = await registry(clock)
        router, poll = setup(models, clock, strict=True)
        await poll.poll_once()
        assert router.pins is not None
        await router.pins.set_if("m\x00old-session", "v1", expected=None)
        assert (await router.choose("m", None, None)).version == "v1"
        poll.board = FailingBoard()  # reads go on; the view cannot be published
        clock.advance(0.5)
        with pytest.raises(ConnectionError):
            await poll.poll_once()  # read, publish due and failed: no renewal
        assert router.renewed_at == 100.0
        clock.advance(LEASE_S - 0.5)
        assert not router.is_stale  # exactly the lease: still routing
        clock.advance(0.01)
        assert router.is_stale
        for session in (None, "new-session"):
            refused = await router.choose("m", None, session)
            assert (refused.status_code, refused.retry_after_s) == (503, 1.0)
            assert refused.reason.startswith("routing view stale")
        assert await router.pins.get("m\x00new-session") is None  # refused: nothing pinned
        assert (await router.choose("m", "v1", None)).status_code == 200  # explicit
        pinned = await router.choose("m", None, "old-session")
        assert (pinned.version, pinned.is_pinned, pinned.status_code) == ("v1", True, 200)
        poll.board = models
        await poll.poll_once()  # read and published again: routing again
        assert (await router.choose("m", None, None)).version == "v1"

    asyncio.run(story())


def test_a_bounded_router_never_refuses() -> None:
    async def story() -> None:
        clock = ManualClock(100.0)
        router, poll = setup(await registry(clock), clock, strict=False)
        await poll.poll_once()
        clock.advance(3600.0)
        assert not router.is_stale
        assert (await router.choose("m", None, None)).version == "v1"

    asyncio.run(story())


def test_a_flip_counts_once_its_live_version_is_routable_and_strict_never_falls_back() -> None:
    async def story() -> None:
        clock = ManualClock(100.0)
        models = await registry(clock)
        await models.set_routing(ModelRouting("m", live="v2", previous="v1"),
                                 expected_revision=1)
        only_v1 = InstanceSet([view("a", version="v1")])
        bounded, _ = setup(models, clock, strict=False, instances=only_v1)
        strict, _ = setup(models, clock, strict=True, instances=only_v1)
        await bounded.refresh()
        await strict.refresh()
        strict.renew(clock())  # as a published poll does
        assert bounded.served_revisions() == ()  # live v2 not routable: not served yet
        assert strict.served_revisions() == (("m", 2),)  # routed to v2 (503 until it is up)
        assert (await bounded.choose("m", None, None)).version == "v1"  # falls back
        assert (await strict.choose("m", None, None)).version == "v2"  # never to previous

    asyncio.run(story())


def test_the_poll_loop_ends_on_a_cancel_that_the_step_turned_into_another_error() -> None:
    converted: list[bool] = []

    async def step() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:  # what redis-py's timeout does at its deadline, once
            if converted:
                raise
            converted.append(True)
            raise TimeoutError from None

    async def story() -> None:
        task = asyncio.create_task(every(0.01, step))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        is_ended = task.done()  # before: the error was logged and the loop went on
        if not is_ended:
            task.cancel()  # not converted this time: the loop ends
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert is_ended and task.cancelled() and converted == [True]

    asyncio.run(story())


def test_an_adapters_flip_counts_once_an_instance_lists_its_live_version() -> None:
    """A strict adapter release waits for the gateways' views like a model's: the adapter's
    revision is served once its live version is listed (or its previous one is not)."""
    async def story() -> None:
        clock = ManualClock(100.0)
        models = await registry(clock)
        for version in ("v1", "v2"):
            await models.add_version(ModelVersion("sql", version, f"sim:{version}", base="m"))
        await models.set_routing(ModelRouting("sql", live="v2", previous="v1"),
                                 expected_revision=0)

        def lists(*adapters: str) -> InstanceSet:
            load = ReportedLoad(0, 0, adapters={a: AdapterResidency(a) for a in adapters})
            listing = view("a", version="v1")
            listing.reported = load
            return InstanceSet([listing])

        for listed, served in ((("sql@v1",), False), (("sql@v1", "sql@v2"), True),
                               ((), True)):
            router, _ = setup(models, clock, strict=True, instances=lists(*listed))
            await router.refresh()
            assert (("sql", 1) in router.served_revisions()) is served, listed
            assert ("m", 1) in router.served_revisions()

    asyncio.run(story())
