"""Release stories: the controller against memory registries and a fake launcher (release_world).

Model `m`: v1 live on 2 instances (m-v1-0, m-v1-1); the launcher names new instances in order,
so a release of v2 starts m-v2-2 and m-v2-3.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
from release_world import CONFIG, World, states

from strata.errors import ConfigError, ConflictError, InvalidRequestError, ModelNotFoundError
from strata.registry.models import (
    ModelRegistry,
    ModelVersion,
    PoolSize,
    Release,
    ReleaseState,
    Strategy,
)
from strata.registry.releases.controller import ReleaseController
from strata.registry.releases.policy import ReleaseConfig, VersionHealth, judge_canary

S = ReleaseState
BLUE_GREEN_PATH = ["pending", "starting", "warming", "flipping", "retiring", "done"]
CANARY_PATH = ["pending", "starting", "warming", "canary", "flipping", "retiring", "done"]
HEALTHY = {"v1": VersionHealth(100, 0, 100.0), "v2": VersionHealth(25, 1, 120.0)}
ERRORS = {"v1": VersionHealth(100, 0, 100.0), "v2": VersionHealth(40, 12, 100.0)}
SLOW = {"v1": VersionHealth(100, 0, 100.0), "v2": VersionHealth(40, 0, 500.0)}


def story(body: Callable[[World], Awaitable[None]]) -> None:
    async def main() -> None:
        await body(await World.create())

    asyncio.run(main())


async def assert_done(world: World, final: Release, replicas: int = 2) -> None:
    """`to` live on `replicas` READY instances; `from` is previous, gone, its deployment too."""
    assert final.state is S.DONE, final.reason
    assert await world.routing() == (final.to_version, final.from_version, None)
    assert await world.deployments() == [(final.to_version, replicas, "active")]
    assert len(await world.ready_ids(final.to_version)) == replicas
    assert [r.version for r in await world.instances.list_instances()] == [
        final.to_version] * replicas


async def assert_rolled_back(world: World, final: Release) -> None:
    """`from` still live on its 2 original instances; nothing of `to` is left."""
    assert final.state is S.ROLLED_BACK
    assert await world.routing() == ("v1", None, None)
    assert await world.deployments() == [("v1", 2, "active")]
    assert [r.instance_id for r in await world.instances.list_instances()] == [
        "m-v1-0", "m-v1-1"]
    assert await world.ready_ids("v1") == ["m-v1-0", "m-v1-1"]


# --- blue-green -------------------------------------------------------------------------------


def test_blue_green_release_flips_only_when_every_new_instance_is_warm() -> None:
    async def body(world: World) -> None:
        controller = world.controller("a")
        release = await controller.start("m", "v2")
        assert (release.state, release.from_version, release.replicas) == (S.PENDING, "v1", 2)
        assert release.owner == "a" and release.release_id.startswith("m-v2-")
        final = await controller.drive(release.release_id)
        assert states(final) == BLUE_GREEN_PATH
        assert final.reason == ""
        await assert_done(world, final)
        assert world.warmed == ["m-v2-2", "m-v2-3"]
        assert final.stats["ready_to_flip_s"] == 0.0
        # v1 kept all its traffic until the flip, and drained only propagation_s after it
        assert world.routings[0] == ("v1", None, 0.0) and world.routings[-1] == ("v2", None, 0.0)
        first_drain = min(t for t, what in world.launcher.events if what.startswith("drain"))
        assert first_drain >= final.stats["flipped_at"] + CONFIG.propagation_s
        assert [e for _, e in world.launcher.events if "v1" in e] == [
            "drain m-v1-0", "drain m-v1-1", "gone m-v1-0", "gone m-v1-1", "delete m@v1"]

    story(body)


def test_first_release_of_a_model_has_nothing_to_retire() -> None:
    async def body(world: World) -> None:
        await world.models.add_version(ModelVersion("n", "v1", "sim:v1"))  # never released
        controller = world.controller("a")
        release = await controller.start("n", "v1")
        assert (release.from_version, release.replicas) == (None, 1)
        final = await controller.drive(release.release_id)
        assert states(final) == BLUE_GREEN_PATH
        routing = await world.models.get_routing("n")
        assert routing is not None and (routing.live, routing.previous) == ("v1", None)
        assert [(d.key, d.replicas, d.state.value) for d in await world.models.list_deployments()
                if d.name == "n"] == [("n@v1", 1, "active")]
        assert [r.instance_id for r in await world.instances.list_instances()
                if r.model == "n"] == ["n-v1-2"]

    story(body)


def test_blue_green_on_the_real_clock_runs_to_done() -> None:
    """The defaults (time.time, asyncio.sleep) with short timeouts, the launcher in a task.
    (How soon it flips after ready is measured by bench/release_switch.py, not asserted here.)"""
    async def main() -> None:
        world = await World.create(clock=time.time, launch_s=0.05)
        config = replace(CONFIG, poll_s=0.01, lease_s=1.0, propagation_s=0.05)

        async def launch() -> None:
            while True:
                await world.sleep(0.01)

        launcher = asyncio.create_task(launch())
        controller = ReleaseController(world.models, world.instances, owner="a",
                                       warm=world.warm, config=config)
        try:
            release = await controller.start("m", "v2")
            final = await asyncio.wait_for(controller.drive(release.release_id), 10.0)
        finally:
            launcher.cancel()
        assert states(final) == BLUE_GREEN_PATH
        assert final.stats["ready_to_flip_s"] >= 0.0
        await assert_done(world, final)

    asyncio.run(main())


# --- canary -----------------------------------------------------------------------------------


def test_healthy_canary_is_watched_for_its_window_then_promoted() -> None:
    async def body(world: World) -> None:
        world.health.update(HEALTHY)
        controller = world.controller("a")
        release = await controller.start("m", "v2", strategy=Strategy.CANARY, canary_weight=0.25)
        final = await controller.drive(release.release_id)
        assert states(final) == CANARY_PATH
        await assert_done(world, final)
        assert ("v1", "v2", 0.25) in world.routings
        entered = dict(final.history)
        assert CONFIG.canary_window_s <= entered["flipping"] - entered["canary"] < 3.0 + 0.2

    story(body)


@pytest.mark.parametrize(("health", "reason"), [
    (ERRORS, "canary m@v2: error rate 30.0% (12 of 40 requests) above "
             "canary_max_error_rate 5.0%"),
    (SLOW, "canary m@v2: TTFT p99 500 ms is 5.0x the live version's 100 ms, above "
           "canary_max_ttft_p99_ratio 2.0"),
], ids=["errors", "slow-ttft"])
def test_failing_canary_rolls_back_with_the_numbers(health: dict[str, VersionHealth],
                                                    reason: str) -> None:
    async def body(world: World) -> None:
        world.health.update(health)
        controller = world.controller("a")
        release = await controller.start("m", "v2", strategy=Strategy.CANARY, canary_weight=0.25)
        final = await controller.drive(release.release_id)
        assert states(final) == ["pending", "starting", "warming", "canary", "rolling_back",
                                 "rolled_back"]
        assert final.reason == reason
        await assert_rolled_back(world, final)
        assert ("v1", "v2", 0.25) in world.routings  # the canary did get its share

    story(body)


def test_a_canary_whose_instance_dies_rolls_back_though_its_numbers_look_healthy() -> None:
    async def body(world: World) -> None:
        world.health.update(HEALTHY)  # the gateways count no request of a canary they cannot reach
        controller = world.controller("a")
        release = await controller.start("m", "v2", strategy=Strategy.CANARY, canary_weight=0.25)
        task = asyncio.create_task(controller.drive(release.release_id))
        await world.wait_for(release.release_id, S.CANARY)
        await world.instances.deregister("m-v2-3")  # its process exited; a launcher restarts it
        final = await task
        assert states(final) == ["pending", "starting", "warming", "canary", "rolling_back",
                                 "rolled_back"]
        assert final.reason == ("canary m@v2: 1 of 2 instances ready during the canary window "
                                "(an instance died or was restarted)")
        await assert_rolled_back(world, final)

    story(body)


@pytest.mark.parametrize(("canary", "live", "verdict"), [
    (VersionHealth(19, 19, 900.0), VersionHealth(100, 0, 100.0), ""),  # too few to judge
    (VersionHealth(20, 1, 200.0), VersionHealth(100, 0, 100.0), ""),  # 5% and 2.0x: at the line
    (VersionHealth(20, 2, None), VersionHealth(100, 0, 100.0), "error rate 10.0%"),
    (VersionHealth(20, 0, 201.0), VersionHealth(100, 0, 100.0), "2.0x"),
    (VersionHealth(20, 0, 900.0), VersionHealth(0, 0, None), ""),  # no live TTFT to compare
])
def test_judge_canary(canary: VersionHealth, live: VersionHealth, verdict: str) -> None:
    found = judge_canary("m", "v2", canary, live, CONFIG)
    assert (verdict in found) if verdict else found == ""
    assert bool(found) == bool(verdict)


# --- failures before the flip -----------------------------------------------------------------


def test_new_instances_not_ready_in_time_roll_back() -> None:
    async def body(world: World) -> None:
        world.launcher.never_ready.add("v2")
        controller = world.controller("a")
        final = await controller.drive((await controller.start("m", "v2")).release_id)
        assert states(final) == ["pending", "starting", "rolling_back", "rolled_back"]
        assert final.reason == "0 of 2 instances of m@v2 ready after ready_timeout_s=10.0"
        await assert_rolled_back(world, final)
        assert world.warmed == []

    story(body)


def test_a_failing_warm_request_rolls_back_after_retries() -> None:
    async def body(world: World) -> None:
        world.broken.add("v2")
        controller = world.controller("a")
        final = await controller.drive((await controller.start("m", "v2")).release_id)
        assert states(final) == ["pending", "starting", "warming", "rolling_back", "rolled_back"]
        assert final.reason == ("warming m@v2 on instance m-v2-2 failed 3 times; "
                                "last: RuntimeError: v2 is broken")
        assert sorted(world.warmed) == ["m-v2-2"] * 3 + ["m-v2-3"] * 3
        await assert_rolled_back(world, final)

    story(body)


# --- rollback ---------------------------------------------------------------------------------


def test_rollback_requested_mid_release_is_continued_by_the_driver() -> None:
    async def body(world: World) -> None:
        world.launcher.start_s = 3.0
        driver, other = world.controller("a"), world.controller("b")
        release = await driver.start("m", "v2")
        task = asyncio.create_task(driver.drive(release.release_id))
        await world.wait_for(release.release_id, S.STARTING)
        requested = await other.request_rollback("m")
        assert (requested.state, requested.reason, requested.owner) == (
            S.ROLLING_BACK, "rollback requested", "a")
        assert await other.request_rollback("m") == requested  # asking twice changes nothing
        final = await task
        assert states(final) == ["pending", "starting", "rolling_back", "rolled_back"]
        assert final.reason == "rollback requested"
        await assert_rolled_back(world, final)

    story(body)


def test_rollback_after_done_releases_the_previous_version() -> None:
    async def body(world: World) -> None:
        controller = world.controller("a")
        release = await controller.start("m", "v2")
        await assert_done(world, await controller.drive(release.release_id))
        back = await controller.request_rollback("m")
        assert (back.to_version, back.from_version, back.strategy, back.replicas) == (
            "v1", "v2", Strategy.BLUE_GREEN, 2)
        final = await controller.drive(back.release_id)
        assert states(final) == BLUE_GREEN_PATH
        await assert_done(world, final)
        assert await world.routing() == ("v1", "v2", None)
        assert await world.ready_ids("v1") == ["m-v1-4", "m-v1-5"]  # new instances, warmed
        assert world.warmed[-2:] == ["m-v1-4", "m-v1-5"]

    story(body)


FLIPPED_BACK = ["pending", "starting", "warming", "flipping", "retiring", "rolling_back",
                "rolled_back"]


async def flipped_back(world: World, final: Release, v1_ids: list[str]) -> None:
    """v1 live again on `v1_ids` (its deployment ACTIVE), v2 previous and gone."""
    assert (final.state, final.reason) == (S.ROLLED_BACK, "rollback requested")
    assert states(final) == FLIPPED_BACK
    assert await world.routing() == ("v1", "v2", None)
    assert await world.deployments() == [("v1", 2, "active")]
    assert [r.instance_id for r in await world.instances.list_instances()] == v1_ids
    assert await world.ready_ids("v1") == v1_ids
    assert final.stats["flipped_back_at"] >= final.stats["flipped_at"]


async def until_event(world: World, event: str) -> None:
    """Yield to the background driver until the launcher has done `event`."""
    for _ in range(10_000):
        if any(what == event for _, what in world.launcher.events):
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the launcher never did {event!r}")


def test_rollback_while_retiring_flips_back_to_the_old_instances_still_up() -> None:
    async def body(world: World) -> None:
        driver, other = world.controller("a"), world.controller("b")
        release = await driver.start("m", "v2")
        task = asyncio.create_task(driver.drive(release.release_id))
        await world.wait_for(release.release_id, S.RETIRING)  # flipped; v1 not drained yet
        requested = await other.request_rollback("m")
        assert (requested.state, requested.owner) == (S.ROLLING_BACK, "a")
        final = await task
        await flipped_back(world, final, ["m-v1-0", "m-v1-1"])  # the same instances, warmed
        assert world.warmed[-2:] == ["m-v1-0", "m-v1-1"]
        assert not [e for _, e in world.launcher.events if e.startswith("drain m-v1")]
        assert [e for _, e in world.launcher.events if "v2" in e][-3:] == [
            "gone m-v2-2", "gone m-v2-3", "delete m@v2"]

    story(body)


def test_rollback_after_the_old_version_drained_starts_it_again() -> None:
    async def body(world: World) -> None:
        driver = world.controller("a")
        release = await driver.start("m", "v2")
        task = asyncio.create_task(driver.drive(release.release_id))
        await until_event(world, "drain m-v1-1")
        await world.controller("b").request_rollback("m")
        final = await task
        await flipped_back(world, final, ["m-v1-4", "m-v1-5"])  # started anew, then warmed
        assert world.warmed[-2:] == ["m-v1-4", "m-v1-5"]
        events = [e for _, e in world.launcher.events]
        # live stayed v2 until the new v1 instances were ready and warm
        assert events.index("ready m-v1-5") < events.index("drain m-v2-2")
        assert ("v1", "v2", None) not in world.routings[:events.index("ready m-v1-5")]

    story(body)


def test_a_rollback_that_cannot_bring_the_old_version_back_fails_and_keeps_the_new() -> None:
    async def body(world: World) -> None:
        driver = world.controller("a")
        release = await driver.start("m", "v2")
        task = asyncio.create_task(driver.drive(release.release_id))
        await until_event(world, "drain m-v1-1")
        world.launcher.never_ready.add("v1")
        await world.controller("b").request_rollback("m")
        final = await task
        assert final.state is S.FAILED
        assert final.reason == ("rollback failed: 0 of 2 instances of m@v1 ready after "
                                "ready_timeout_s=10.0; m@v2 stays live")
        assert await world.routing() == ("v2", "v1", None)
        for _ in range(3):  # the launcher drains v1's new instances and deletes it
            await world.sleep(world.launcher.stop_s)
        assert await world.deployments() == [("v2", 2, "active")]
        assert await world.ready_ids("v2") == ["m-v2-2", "m-v2-3"]

    story(body)


@pytest.mark.parametrize("when", ["entered", "leaving"])
def test_a_rollback_after_the_flip_is_resumed_by_another_controller(when: str) -> None:
    """a crashes at its first write while rolling back (entered: a lease renewal or the
    flip-back's stats) or right before it records rolled_back (leaving, everything done);
    b resumes to the same end."""
    async def body(world: World) -> None:
        crashing = world.controller("a", models=CrashingModels(world.models, S.ROLLING_BACK,
                                                                when))
        release = await crashing.start("m", "v2")
        task = asyncio.create_task(crashing.drive(release.release_id))
        await world.wait_for(release.release_id, S.RETIRING)
        await world.controller("b").request_rollback("m")
        with pytest.raises(asyncio.CancelledError):
            await task
        await world.sleep(CONFIG.lease_s)
        resumer = world.controller("b")
        assert [r.release_id for r in await resumer.resumable()] == [release.release_id]
        final = await resumer.drive(release.release_id)
        await flipped_back(world, final, ["m-v1-0", "m-v1-1"])

    story(body)


def test_the_first_release_cannot_be_rolled_back_after_its_flip() -> None:
    async def body(world: World) -> None:
        await world.models.add_version(ModelVersion("n", "v1", "sim:v1"))
        crashing = world.controller("a", models=CrashingModels(world.models, S.RETIRING,
                                                                "entered"))
        release = await crashing.start("n", "v1")
        with pytest.raises(asyncio.CancelledError):  # stopped in retiring, after its flip
            await asyncio.create_task(crashing.drive(release.release_id))
        with pytest.raises(InvalidRequestError, match="first of n: v1 is live and there is no "
                                                      "earlier version"):
            await world.controller("b").request_rollback("n")

    story(body)


def test_finished_releases_beyond_keep_releases_are_deleted() -> None:
    async def body(world: World) -> None:
        controller = world.controller("a", config=replace(CONFIG, keep_releases=2))
        ids = []
        for version in ("v2", "v3", "v2", "v3"):
            release = await controller.start("m", version)
            ids.append(release.release_id)
            assert (await controller.drive(release.release_id)).state is S.DONE
        assert [r.release_id for r in await world.models.list_releases("m")] == ids[-2:]

    story(body)


def test_rollback_needs_a_previous_version() -> None:
    async def body(world: World) -> None:
        with pytest.raises(InvalidRequestError, match="'m' has no previous version"):
            await world.controller("a").request_rollback("m")

    story(body)


# --- starting: what may be released -----------------------------------------------------------


def test_start_refuses_what_cannot_be_released() -> None:
    async def body(world: World) -> None:
        controller = world.controller("a")
        with pytest.raises(ModelNotFoundError, match=r"no version m@v9; known versions of 'm': "
                                                     r"v1, v2, v3"):
            await controller.start("m", "v9")
        with pytest.raises(InvalidRequestError, match="m@v1 is already live"):
            await controller.start("m", "v1")
        with pytest.raises(InvalidRequestError, match=r"canary weight must be in \(0, 1\)"):
            await controller.start("m", "v2", strategy=Strategy.CANARY, canary_weight=1.0)
        blind = world.controller("c", health=None)
        with pytest.raises(InvalidRequestError, match="no health source"):
            await blind.start("m", "v2", strategy=Strategy.CANARY)
        with pytest.raises(InvalidRequestError, match="replicas must be >= 1"):
            await controller.start("m", "v2", replicas=0)

    story(body)


def test_one_release_per_model() -> None:
    async def body(world: World) -> None:
        first = await world.controller("a").start("m", "v2")
        with pytest.raises(ConflictError, match=(
                f"'m' already has a release in progress: {first.release_id} "
                r"\(v1 -> v2, pending\).*strata rollback m")):
            await world.controller("b").start("m", "v3")
        await assert_done(world, await world.controller("a").drive(first.release_id))
        second = await world.controller("b").start("m", "v3")  # the first one is done
        assert (second.from_version, second.to_version) == ("v2", "v3")

    story(body)


@pytest.mark.parametrize(("change", "message"), [
    ({"poll_s": 0.0}, "poll_s must be > 0"),
    ({"lease_s": 0.3}, r"lease_s \(0.3\) must be at least 2 x poll_s"),
    ({"propagation_s": -1.0}, "propagation_s must be >= 0"),
    ({"canary_min_requests": 0}, "canary_min_requests must be >= 1"),
    ({"canary_max_error_rate": 1.5}, r"canary_max_error_rate must be in \[0, 1\]"),
])
def test_release_config_says_what_to_change(change: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReleaseConfig(**change)  # type: ignore[arg-type]


# --- leases, crashes and resuming -------------------------------------------------------------


def test_a_second_controller_cannot_take_a_live_lease() -> None:
    async def body(world: World) -> None:
        world.launcher.start_s = 8.0  # STARTING outlasts several leases: the driver renews it
        driver, other = world.controller("a"), world.controller("b")
        release = await driver.start("m", "v2")
        assert await other.resumable() == []  # leased from creation: start() then drive()
        task = asyncio.create_task(driver.drive(release.release_id))
        await world.wait_for(release.release_id, S.STARTING)
        started_at = world.clock()
        for _ in range(2):
            with pytest.raises(ConflictError, match=f"{release.release_id} is driven by 'a'"):
                await other.drive(release.release_id)
            assert await other.resumable() == []
            while world.clock() < started_at + 3 * CONFIG.lease_s:
                await asyncio.sleep(0)
        with pytest.raises(ConflictError, match="already being driven by this controller"):
            await driver.drive(release.release_id)
        final = await task
        assert (final.owner, states(final)) == ("a", BLUE_GREEN_PATH)

    story(body)


def test_a_driver_whose_release_was_taken_over_stops() -> None:
    async def body(world: World) -> None:
        world.launcher.start_s = 3.0
        driver = world.controller("a")
        release = await driver.start("m", "v2")
        task = asyncio.create_task(driver.drive(release.release_id))
        stored = await world.wait_for(release.release_id, S.STARTING)
        # what a second controller's drive() writes once a's lease has lapsed (a was stuck)
        await world.models.put_release(replace(stored, owner="b", lease_until=world.clock() + 60),
                                       expected_revision=stored.revision)
        last_seen = await task
        assert (last_seen.owner, last_seen.state) == ("b", S.STARTING)
        final = await world.controller("b").drive(release.release_id)
        assert (final.owner, states(final)) == ("b", BLUE_GREEN_PATH)
        await assert_done(world, final)

    story(body)


class CrashingModels:
    """The model registry as a controller that dies sees it: its drive task is cancelled right
    after it stores `state` ("entered"), or right before it stores the state after it
    ("leaving", every effect of the step done but not recorded)."""

    def __init__(self, inner: ModelRegistry, state: ReleaseState, when: str) -> None:
        self.inner, self.state, self.when = inner, state, when

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def put_release(self, release: Release, *, expected_revision: int) -> Release:
        if expected_revision and self.when == "leaving" and release.state is not self.state:
            stored = await self.inner.get_release(release.release_id)
            if stored is not None and stored.state is self.state:
                raise asyncio.CancelledError
        written = await self.inner.put_release(release, expected_revision=expected_revision)
        if expected_revision and self.when == "entered" and written.state is self.state:
            raise asyncio.CancelledError
        return written


CRASHES = [(health, state, when)
           for health, crash_states in [
               ({}, (S.PENDING, S.STARTING, S.WARMING, S.FLIPPING, S.RETIRING)),
               (HEALTHY, (S.CANARY,)), (ERRORS, (S.CANARY, S.ROLLING_BACK))]
           for state in crash_states for when in ("entered", "leaving")]


@pytest.mark.parametrize(("health", "state", "when"), CRASHES, ids=[
    f"{'canary-bad' if h is ERRORS else 'canary-ok' if h else 'blue-green'}-{s}-{w}"
    for h, s, w in CRASHES])
def test_a_release_whose_controller_crashed_is_resumed_by_another(
        health: dict[str, VersionHealth], state: ReleaseState, when: str) -> None:
    async def body(world: World) -> None:
        world.health.update(health)
        strategy = Strategy.CANARY if health else Strategy.BLUE_GREEN
        crashing = world.controller("a", models=CrashingModels(world.models, state, when))
        release = await crashing.start("m", "v2", strategy=strategy, canary_weight=0.25)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(crashing.drive(release.release_id))
        stored = await world.models.get_release(release.release_id)
        assert stored is not None and (stored.state, stored.owner) == (state, "a")

        resumer = world.controller("b")
        assert await resumer.resumable() == []  # a's lease is still live
        await world.sleep(CONFIG.lease_s)
        assert [r.release_id for r in await resumer.resumable()] == [release.release_id]
        final = await resumer.drive(release.release_id)
        assert final.owner == "b"
        if health is ERRORS:
            assert states(final) == ["pending", "starting", "warming", "canary", "rolling_back",
                                     "rolled_back"]
            await assert_rolled_back(world, final)
        else:
            assert states(final) == (CANARY_PATH if health else BLUE_GREEN_PATH)
            await assert_done(world, final)
        assert await resumer.resumable() == []

    story(body)


def test_a_release_lays_the_new_version_out_in_the_pools_of_the_one_it_replaces() -> None:
    """v1 runs as 1 prefill + 1 decode instance: v2's deployment gets the same pools, so a
    release does not turn a P/D model into mixed instances."""
    async def body(world: World) -> None:
        pools = (PoolSize("prefill", "default", 1), PoolSize("decode", "default", 1))
        current = next(d for d in await world.models.list_deployments() if d.version == "v1")
        await world.models.put_deployment(replace(current, pools=pools),
                                          expected_revision=current.revision)
        controller = world.controller("a")
        final = await controller.drive((await controller.start("m", "v2")).release_id)
        assert final.state is S.DONE, final.reason
        v2 = next(d for d in await world.models.list_deployments() if d.version == "v2")
        assert (v2.replicas, v2.pools) == (2, pools)

    story(body)
