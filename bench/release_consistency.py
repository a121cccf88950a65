"""Caches across a release, measured: how long the old version still answers new requests after a
flip, at `--release-consistency bounded` and `strict`, and what strict's wait adds to the flip.

    PYTHONPATH=. .venv/bin/python bench/release_consistency.py [--rounds 3]

Each round starts a fresh fleet (tests/harness/release_fleet.py: two gateways, `a` on the
registry directly and `b` through a loopback proxy, each with a memory response cache;
simulated instances of m@v1 and m@v2 that register themselves; one real redis-server as the
registry; routing poll 0.2 s, routing lease 2 s), sends the same deterministic request every
5 ms, alternating the gateways, and releases m@v2 through gateway a. Scenarios:

- bounded: today's behaviour.
- strict: the same, every gateway healthy.
- strict-cut: gateway b's registry connection is paused just before the release (a partition).

Per scenario and gateway it reports the stale window: the time from a reference to the sending
of the last request that was sent after the flip's compare-and-set and answered by v1 (None
when none was; the summary takes the worst gateway of each round). Bounded: from the flip's
write (what bounds it is the poll). Strict: from the flip's completion (the release entering
`retiring`), which must be <= 0: no request sent after the release reported its flip is
answered by v1. Also: the flip's added latency (`flip_acked_s`, write to completion; bounded
does not wait), the gateways acked and fenced, and the answers refused 503 (a fenced gateway).
Writes .bench/results/release_consistency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.redis_server import RedisServer
from harness.release_fleet import MODEL, Answer, ReleaseFleet, entered

from strata.registry.models import create_model_registry
from strata.state.redis_db import find_redis_server

RESULTS = Path(__file__).resolve().parent.parent / ".bench" / "results"
BASE = ["--response-cache", "memory://", "--usage-store", "memory://", "--routing-poll-s", "0.2",
        "--log-level", "critical"]
SCENARIOS: dict[str, tuple[list[str], bool]] = {  # flags, cut b
    "bounded": ([], False),
    "strict": (["--release-consistency", "strict", "--routing-lease-s", "2"], False),
    "strict-cut": (["--release-consistency", "strict", "--routing-lease-s", "2"], True),
}
STEADY_S, AFTER_S, INTERVAL_S = 1.0, 1.5, 0.005


def last_old_answer(answers: list[Answer], gateway: str, flipped_at: float) -> float | None:
    """When the last request sent to `gateway` after the flip's write and answered by v1 was
    sent (None: none was)."""
    late = [a.sent_at for a in answers
            if a.gateway == gateway and a.sent_at > flipped_at and a.version == f"{MODEL}@v1"]
    return max(late) if late else None


async def published_views(redis_url: str) -> list[dict[str, Any]]:
    """The routing views in the registry (the fleet's two gateways; a third is a process that
    is not ours polling this server's port, e.g. another user's gateway on a reused port)."""
    models = create_model_registry(redis_url)
    try:
        return [{"gateway": v.gateway, "revisions": v.revisions, "level": v.level, "seq": v.seq}
                for v in await models.list_views()]
    finally:
        await models.close()


def one_round(redis_url: str, flags: list[str], cut: bool) -> dict[str, Any]:
    fleet = ReleaseFleet(redis_url, [*BASE, *flags]).start()
    try:
        stream = fleet.stream(INTERVAL_S)
        time.sleep(STEADY_S)
        if cut:
            fleet.cut_b()
        release = fleet.release()
        time.sleep(AFTER_S)
        answers = stream.finish()
        views = asyncio.run(published_views(fleet.redis_url))
    finally:
        fleet.stop()
    flipped_at, reported_at = release.stats["flipped_at"], entered(release, "retiring")
    is_strict = "strict" in flags
    reference = reported_at if is_strict else flipped_at
    windows: dict[str, float | None] = {}
    for gateway in ("a", "b"):
        last = last_old_answer(answers, gateway, flipped_at)
        windows[gateway] = None if last is None else last - reference
    return {"stale_window_s": windows, "views": views, "flip_to_report_s": reported_at - flipped_at,
            "flip_acked_s": release.stats.get("flip_acked_s"),
            "gateways_acked": release.stats.get("gateways_acked"),
            "gateways_fenced": release.stats.get("gateways_fenced"),
            "num_requests": len(answers),
            "num_refused_503": sum(a.status == 503 for a in answers),
            "num_failed_other": sum(a.status not in (200, 503) for a in answers),
            "num_old_after_report": sum(a.sent_at > reported_at and a.version == f"{MODEL}@v1"
                                        for a in answers)}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    worst = [max(w for w in r["stale_window_s"].values() if w is not None) for r in rounds
             if any(w is not None for w in r["stale_window_s"].values())]
    report = [r["flip_to_report_s"] for r in rounds]
    return {"stale_window_s_max": max(worst, default=None),
            "stale_window_s_median": statistics.median(worst) if worst else None,
            "num_rounds_without_old_answers": len(rounds) - len(worst),
            "flip_to_report_s_median": statistics.median(report),
            "flip_to_report_s_max": max(report),
            "num_old_after_report": sum(r["num_old_after_report"] for r in rounds),
            "num_refused_503": sum(r["num_refused_503"] for r in rounds),
            "num_failed_other": sum(r["num_failed_other"] for r in rounds)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    binary = find_redis_server()
    assert binary is not None, "redis-server is needed (apt install redis-server)"
    results: dict[str, Any] = {"rounds": args.rounds, "routing_poll_s": 0.2,
                               "routing_lease_s": 2.0, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis", binary)
        server.start()
        try:
            for name, (flags, cut) in SCENARIOS.items():
                rounds = [one_round(server.url, flags, cut) for _ in range(args.rounds)]
                results["scenarios"][name] = {"summary": summary(rounds), "rounds": rounds}
                print(name, json.dumps(results["scenarios"][name]["summary"]), flush=True)
        finally:
            server.stop()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "release_consistency.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
