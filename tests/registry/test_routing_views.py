"""The gateways' routing views and the strict flip that waits for them.

- The ViewBoard contract on every backend (memory, SQLite, a real Redis).
- FlipWatch: a view with the flip's revision is acked; one that stops changing for longer than
  its lease, timed on the driver's clock from its first reading after the flip, is fenced
  (strict) or unfenced (bounded); a view that changes is timed anew.
- A strict release on the fake clock: with one gateway silent, the flip is not reported (the
  release stays `flipping`) until the silence passes that gateway's lease; a gateway that
  comes back with the new revision is acked instead. A bounded release does not wait. A
  rollback's flip back waits the same way before the new version retires.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from model_registries import Make, make_fixture, story  # noqa: F401  (the `make` fixture)
from redis_server import redis_server, redis_url  # noqa: F401
from registry.release_world import CONFIG, World, states

from strata.clock import ManualClock
from strata.registry.models import ModelRegistry, Release, ReleaseState
from strata.registry.models.views import VIEW_RETENTION_S, RoutingView
from strata.registry.releases.controller import ReleaseConfig, ReleaseController
from strata.registry.releases.flip_acks import FlipAcks, FlipWatch

STRICT_CONFIG = replace(CONFIG, consistency="strict")


def test_views_are_replaced_per_gateway_listed_sorted_and_aged_out(make: Make) -> None:
    async def body(reg: ModelRegistry, clock: ManualClock) -> None:
        assert await reg.list_views() == []
        b = await reg.put_view(RoutingView("gw-b", (("m", 3),), 990.0, 2.0, "strict", 1))
        assert b == RoutingView("gw-b", (("m", 3),), 990.0, 2.0, "strict", 1, published_at=1000.0)
        clock.advance(1.0)
        a = await reg.put_view(RoutingView("gw-a", (("m", 2), ("n", 7)), 1000.5, 2.0))
        assert await reg.list_views() == [a, b]
        assert a.revision_of("n") == 7 and a.revision_of("x") == 0 and not a.is_strict
        clock.advance(1.0)
        b2 = await reg.put_view(replace(b, revisions=(("m", 4),), seq=2))
        assert await reg.list_views() == [a, b2]
        clock.advance(VIEW_RETENTION_S - 0.5)  # a: 60.5 s old, b2: 59.5 s
        assert await reg.list_views() == [b2]
        clock.advance(1.0)
        assert await reg.list_views() == []

    story(make, body)


def view(gateway: str, revision: int, seq: int, *, level: str = "strict",
         published_at: float = 0.0) -> RoutingView:
    return RoutingView(gateway, (("m", revision),), 0.0, 2.0, level, seq, published_at)


def test_flip_watch_acks_fences_and_times_each_view_from_its_first_reading() -> None:
    clock = ManualClock(100.0)
    watch = FlipWatch("m", 5, clock)
    views = [view("a", 4, 1), view("b", 4, 7), view("c", 4, 3, level="bounded")]
    assert watch.judge(views) == FlipAcks(waiting=("a", "b", "c"))
    clock.advance(1.5)
    views[0] = view("a", 5, 2)  # a read the flip
    assert watch.judge(views) == FlipAcks(acked=("a",), waiting=("b", "c"))
    clock.advance(0.4)
    views[1] = view("b", 4, 8)  # b published again (without the flip): timed anew from here
    assert watch.judge(views) == FlipAcks(acked=("a",), waiting=("b", "c"))
    clock.advance(0.2)  # c silent 2.1 s > its 2 s lease; b 0.2 s
    assert watch.judge(views) == FlipAcks(acked=("a",), unfenced=("c",), waiting=("b",))
    clock.advance(1.8)
    assert not watch.judge(views).is_done  # b silent exactly its lease: not yet
    clock.advance(0.01)
    acks = watch.judge(views)
    assert acks == FlipAcks(acked=("a",), fenced=("b",), unfenced=("c",)) and acks.is_done
    assert watch.judge([*views, view("d", 6, 1)]).acked == ("a", "d")


class Gateways:
    """Two gateways' routing polls on the world's clock: `a` always reads and publishes; `b`
    publishes only while `b_reads` (its registry reads fail otherwise). Each publishes the
    routing revision it read, every sleep of the controller."""

    def __init__(self, world: World) -> None:
        self.world, self.b_reads, self.seq = world, True, 0
        self.b_back_at: float | None = None  # b reads again from then

    async def sleep(self, seconds: float) -> None:
        await self.world.sleep(seconds)
        routing = await self.world.models.get_routing("m")
        revision = routing.revision if routing is not None else 0
        self.seq += 1
        if self.b_back_at is not None and self.world.clock() >= self.b_back_at:
            self.b_reads = True
        for gateway in ("a", "b") if self.b_reads else ("a",):
            await self.world.models.put_view(RoutingView(
                gateway, (("m", revision),), self.world.clock(), 2.0, "strict", self.seq))


def run_release(consistency_config: ReleaseConfig, *, b_back_after_s: float | None = None) -> tuple:
    async def main() -> tuple:
        world = await World.create()
        gateways = Gateways(world)
        await gateways.sleep(0.0)  # both published revision 1 (v1 live)
        controller = ReleaseController(world.models, world.instances, owner="driver",
                                       warm=world.warm, config=consistency_config,
                                       clock=world.clock, sleep=gateways.sleep)
        release = await controller.start("m", "v2")
        original = world.models.set_routing

        async def flip_and_cut_b(routing, *, expected_revision):  # type: ignore[no-untyped-def]
            stored = await original(routing, expected_revision=expected_revision)
            if stored.live == "v2":  # the flip: b's reads fail from now on
                gateways.b_reads = False
                if b_back_after_s is not None:
                    gateways.b_back_at = world.clock() + b_back_after_s
            return stored

        world.models.set_routing = flip_and_cut_b  # type: ignore[method-assign]
        final = await controller.drive(release.release_id)
        return world, final

    return asyncio.run(main())


def entered(release: object, state: str) -> float:
    return next(at for s, at in release.history if s == state)  # type: ignore[attr-defined]


def test_strict_flip_waits_until_the_silent_gateway_is_fenced() -> None:
    world, final = run_release(STRICT_CONFIG)
    assert states(final) == ["pending", "starting", "warming", "flipping", "retiring", "done"]
    flipped_at, reported_at = final.stats["flipped_at"], entered(final, "retiring")
    # b's last view was first read after the flip at its first tick (0.05 s); fenced past 2 s
    assert 2.0 < reported_at - flipped_at <= 2.0 + 2 * CONFIG.poll_s / 4
    assert final.stats["flip_acked_s"] == reported_at - flipped_at
    assert (final.stats["gateways_acked"], final.stats["gateways_fenced"]) == (1.0, 1.0)
    assert final.stats["gateways_unfenced"] == 0.0


def test_strict_flip_acks_a_gateway_that_reads_again_within_its_lease() -> None:
    world, final = run_release(STRICT_CONFIG, b_back_after_s=1.0)
    waited = entered(final, "retiring") - final.stats["flipped_at"]
    assert 1.0 <= waited < 1.2
    assert (final.stats["gateways_acked"], final.stats["gateways_fenced"]) == (2.0, 0.0)


def test_bounded_flip_does_not_wait_for_views() -> None:
    world, final = run_release(CONFIG)
    assert entered(final, "retiring") - final.stats["flipped_at"] < 0.01
    assert "flip_acked_s" not in final.stats


def test_strict_flip_back_of_a_rollback_waits_for_the_views_too() -> None:
    async def main() -> tuple[Release, float]:
        world = await World.create()
        gateways = Gateways(world)
        await gateways.sleep(0.0)
        controller = ReleaseController(world.models, world.instances, owner="driver",
                                       warm=world.warm, config=STRICT_CONFIG,
                                       clock=world.clock, sleep=gateways.sleep)
        release = await controller.start("m", "v2")
        task = asyncio.create_task(controller.drive(release.release_id))
        await world.wait_for(release.release_id, ReleaseState.RETIRING)
        gateways.b_reads = False  # b stops reading before the rollback's flip back
        await controller.request_rollback("m")
        final = await task
        drained = [at for at, what in world.launcher.events if what.startswith("drain m-v2")]
        return final, min(drained)

    final, v2_drained_at = asyncio.run(main())
    assert final.state is ReleaseState.ROLLED_BACK
    # v2 retires only once b fenced itself: one lease after the driver first read its view
    assert v2_drained_at - final.stats["flipped_back_at"] > 2.0
    assert final.stats["flip_back_acked_s"] > 2.0
