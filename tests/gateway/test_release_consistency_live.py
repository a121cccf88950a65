"""Caches across a release, over real sockets: two gateways (each with a response cache), simulated
instances of m@v1 and m@v2, one real Redis as the registry (harness/release_fleet.py), a steady
stream of the same deterministic request through both gateways.

- strict: gateway b's registry connection is cut just before the release. The flip is not
  reported until b fenced itself (its view silent past its 2 s lease; the release records one
  gateway acked, one fenced), and no request sent after the flip was reported is answered by
  v1, from an instance or from a response-cache entry: b answers 503 "routing view stale"
  with Retry-After instead. With the wait removed (tried), the flip is reported at its write
  and both gateways answer v1 after that (a until its next poll, b until its lease ends).
- bounded (today's behaviour): the flip is reported at once and the old version answers
  requests sent after the flip's write for at most the routing poll (0.2 s) plus a margin.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness.release_fleet import MODEL, ReleaseFleet, entered, stale_window_s
from redis_server import redis_server, redis_url  # noqa: F401

FLAGS = ["--response-cache", "memory://", "--usage-store", "memory://", "--routing-poll-s", "0.2",
         "--log-level", "error"]
LEASE_S = 2.0
MARGIN_S = 0.5  # the loaded test machine: a poll can run late by this much


@pytest.fixture
def fleet(request: pytest.FixtureRequest, redis_url: str) -> Iterator[ReleaseFleet]:  # noqa: F811
    started = ReleaseFleet(redis_url, [*FLAGS, *request.param]).start()
    yield started
    started.stop()


@pytest.mark.parametrize("fleet", [["--release-consistency", "strict",
                                    "--routing-lease-s", str(LEASE_S)]], indirect=True)
def test_strict_flip_waits_for_the_cut_gateway_to_fence_and_v1_never_answers_after_it(
        fleet: ReleaseFleet) -> None:
    stream = fleet.stream()
    fleet.cut_b()
    release = fleet.release()
    reported_at = entered(release, "retiring")
    answers = stream.finish_after(reported_at + 0.3)

    assert release.state.value == "retiring", release.reason
    after = [a for a in answers if a.sent_at > reported_at]
    assert {a.gateway for a in after} == {"a", "b"}
    assert [a for a in after if a.version == f"{MODEL}@v1"] == []
    assert {(a.gateway, a.status, a.version) for a in after} <= {
        ("a", 200, f"{MODEL}@v2"), ("b", 503, "")}
    assert all(a.retry_after == "1" for a in after if a.status == 503)
    assert (release.stats["gateways_acked"], release.stats["gateways_fenced"]) == (1.0, 1.0)
    assert release.stats["flip_acked_s"] > LEASE_S - 0.5  # b's view went silent at the cut
    # b did answer from v1 after its cut, for up to its lease: the danger the wait covers
    cut_served = [a for a in answers if a.gateway == "b" and a.status == 200
                  and a.sent_at > release.stats["flipped_at"]]
    assert all(a.version == f"{MODEL}@v1" for a in cut_served)


@pytest.mark.parametrize("fleet", [[]], indirect=True)
def test_bounded_flip_is_reported_at_once_and_v1_answers_at_most_a_poll_after_it(
        fleet: ReleaseFleet) -> None:
    stream = fleet.stream()
    release = fleet.release()
    flipped_at = release.stats["flipped_at"]
    answers = stream.finish_after(flipped_at + 1.0)

    assert "flip_acked_s" not in release.stats
    assert entered(release, "retiring") - flipped_at < 0.1
    windows = {g: stale_window_s(answers, g, flipped_at) for g in ("a", "b")}
    assert all(window <= 0.2 + MARGIN_S for window in windows.values()), windows
    assert all(a.status == 200 for a in answers)
    late = [a for a in answers if a.sent_at > flipped_at + 0.2 + MARGIN_S]
    assert late and all(a.version == f"{MODEL}@v2" for a in late)
