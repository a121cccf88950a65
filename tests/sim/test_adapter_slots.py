"""The simulated instance's adapter slots (strata/sim/adapters.py) keep the real table's rules:
LRU eviction of adapters nobody holds, a wait while every slot is held, loads one at a time."""

from __future__ import annotations

from strata.sim.adapters import AdapterSlots


def test_slots_evict_the_least_recently_used_free_adapter_and_load_one_at_a_time() -> None:
    slots = AdapterSlots(num_slots=2, load_s=0.5, known=("a", "b", "c"))
    assert slots.start("a", 0.0) == 0.5         # cold: one load
    assert slots.start("b", 0.1) == 1.0         # the loader is busy with a until 0.5
    assert slots.start("a", 2.0) == 2.0         # resident: ready at once
    assert slots.start("c", 2.0) is None        # a and b both held: no slot
    slots.release("b")
    assert slots.start("c", 3.0) == 3.5         # b (free) evicted, not a (held twice)
    assert [(r.name, r.is_resident, r.num_loads, r.num_evictions) for r in slots.residency()] \
        == [("a", True, 1, 0), ("b", False, 1, 1), ("c", True, 1, 0)]
    assert (slots.num_loads, slots.num_evictions) == (3, 1)
