"""`strata plan --adapters`: adapter slots and k sized on a virtual clock (strata/plan/adapters.py)
through the gateway's own policies: on one small fleet, adapter placement loads fewer adapters
than least-load at a bounded spread; the slot count chosen is the smallest meeting both bounds;
k follows popularity; the command prints the table."""

from __future__ import annotations

import dataclasses

import pytest

from strata.cli import main
from strata.clock import ManualClock
from strata.gateway.routing.policies import create_policy
from strata.plan.adapters import AdapterWorkload, ranks_of, simulate, size_slots

SMALL = AdapterWorkload(num_instances=4, num_adapters=24, zipf=1.0, num_slots=4,
                        in_flight_per_instance=4, duration_s=40.0)


def test_placement_loads_fewer_adapters_than_least_load_within_the_bound() -> None:
    outcomes = {}
    for name in ("adapter_aware", "least_load"):
        clock = ManualClock()
        outcomes[name] = simulate(SMALL, create_policy(name, clock=clock), clock)
    placed, spread = outcomes["adapter_aware"], outcomes["least_load"]
    assert placed.num_requests == spread.num_requests > 500
    assert placed.num_loads < 0.7 * spread.num_loads
    assert placed.served_ratio <= 1.25
    assert placed.replicas["lora-000"] > placed.replicas["lora-023"] == 1  # k by popularity


def test_the_chosen_slot_count_is_the_smallest_that_meets_both_bounds() -> None:
    rows, chosen = size_slots(SMALL, max_loads_per_100=15, max_wait_p99_ms=500,
                              slot_choices=(2, 4, 8, 64))
    assert [n for n, _ in rows] == [2, 4, 8, 24]  # at most one slot per adapter
    fits = [n for n, o in rows if o.loads_per_100 <= 15 and o.wait_p99_ms <= 500]
    assert chosen == fits[0]
    assert rows[-1][1].loads_per_100 < rows[0][1].loads_per_100  # every adapter fits: few loads


def test_ranks_of_groups_equal_k() -> None:
    assert ranks_of([6, 3, 2, 2, 1, 1, 1]) == "1: 6, 2: 3, 3-4: 2, 5-7: 1"


def test_plan_adapters_prints_slots_and_k(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--adapters", "12", "--adapter-instances", "3", "--concurrency", "9",
                 "--adapter-max-loads", "50"]) == 0
    out = capsys.readouterr().out
    assert "12 by Zipf(1.0) over 3 instances, 3 requests in flight each" in out
    assert "chosen: --max-cpu-loras" in out and "by popularity rank: 1: " in out


def test_plan_adapters_needs_a_load() -> None:
    assert main(["plan", "--adapters", "12"]) == 1


def test_a_workload_refuses_nonsense() -> None:
    with pytest.raises(Exception, match="num_slots must be positive"):
        dataclasses.replace(SMALL, num_slots=0)
