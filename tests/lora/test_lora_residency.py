"""--max-cpu-loras as a story over `LoraTable` (strata/server/loras.py), with a fake engine and
loader that record what happens.

At most two adapters resident: a third request loads its adapter on demand and evicts the least
recently used adapter nobody holds; a held adapter is never evicted; when both are held the load
waits its turn and goes on when one is let go; a request for a resident adapter queues behind a
waiting load (no starvation); files changed on disk give a new digest when loaded back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from strata.server.config import ServerConfig
from strata.server.loras import LoraTable
from strata.server.metrics import ServerMetrics


@dataclass
class FakeAdapter:
    name: str
    digest: str
    num_bytes: int = 100


class FakeEngine:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    async def add_lora(self, adapter: Any) -> str:
        self.events.append(f"add {adapter.digest}")
        return str(adapter.digest)

    async def retire_lora(self, digest: str) -> None:
        self.events.append(f"retire {digest}")


def make_table(events: list[str], files: dict[str, str]) -> tuple[LoraTable, ServerMetrics]:
    """Adapters a, b, c, d known at paths /a.. /d; `files[path]` is what is there now."""
    config = ServerConfig(served_model_name="tiny", max_cpu_loras=2,
                          lora_paths={n: f"/{n}" for n in "abcd"})
    metrics = ServerMetrics("tiny")

    def loader(name: str, path: str) -> FakeAdapter:
        return FakeAdapter(name, files[path])
    table = LoraTable(FakeEngine(events), config, loader, metrics.lora)  # type: ignore[arg-type]
    return table, metrics


async def both_slots_held(events: list[str]) -> tuple[LoraTable, asyncio.Task[None]]:
    """a and b resident and held (both slots of 2), and a load of c waiting for room."""
    table, _ = make_table(events, {f"/{n}": f"{n}1" for n in "abcd"})
    await table.acquire("a")
    await table.acquire("b")
    return table, asyncio.create_task(table.acquire("c"))


def sample(metrics: ServerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "tiny"})
    return -1.0 if value is None else value


async def use(table: LoraTable, name: str) -> None:
    await table.acquire(name)
    table.release(name)


def test_lru_eviction_never_takes_a_held_adapter() -> None:
    async def story() -> None:
        events: list[str] = []
        table, metrics = make_table(events, {f"/{n}": f"{n}1" for n in "abcd"})
        await use(table, "a")
        await use(table, "b")
        await use(table, "a")            # b is now the least recently used
        await use(table, "c")
        assert events == ["add a1", "add b1", "retire b1", "add c1"]
        await table.acquire("a")         # held: a stays whatever its age
        await use(table, "c")
        await use(table, "d")            # a is older than c but held: c goes
        assert events[4:] == ["retire c1", "add d1"]
        assert table.config.loras == {"a": "a1", "d": "d1"}
        table.release("a")
        assert table.num_leases("a") == 0
        assert sample(metrics, "strata:lora_resident_adapters") == 2
        assert sample(metrics, "strata:lora_resident_bytes") == 200
        assert sample(metrics, "strata:lora_loads_total") == 4
        assert sample(metrics, "strata:lora_evictions_total") == 2
        assert sample(metrics, "strata:lora_load_seconds_count") == 4
    asyncio.run(story())


def test_a_load_waits_while_every_resident_adapter_is_held() -> None:
    async def story() -> None:
        events: list[str] = []
        table, waiting = await both_slots_held(events)
        resident_a = asyncio.create_task(table.acquire("a"))  # queues behind the load
        await asyncio.sleep(0.05)
        assert not waiting.done() and not resident_a.done()
        assert events == ["add a1", "add b1"]
        table.release("b")               # b is let go: c takes its place
        await asyncio.wait_for(waiting, 1)
        await asyncio.wait_for(resident_a, 1)
        assert events[2:] == ["retire b1", "add c1"]
        assert table.num_leases("a") == 2 and table.num_leases("c") == 1
        for name in ("a", "a", "c"):
            table.release(name)
    asyncio.run(story())


def test_a_cancelled_wait_holds_nothing() -> None:
    async def story() -> None:
        events: list[str] = []
        table, waiting = await both_slots_held(events)
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert table.num_leases("c") == 0 and events == ["add a1", "add b1"]
        table.release("a")
        await use(table, "d")            # the lock was let go: the next load goes on
        assert events[2:] == ["retire a1", "add d1"]
        table.release("b")
    asyncio.run(story())


def test_files_changed_on_disk_are_a_new_digest_when_loaded_back() -> None:
    async def story() -> None:
        events: list[str] = []
        files = {f"/{n}": f"{n}1" for n in "abcd"}
        table, _ = make_table(events, files)
        await use(table, "a")
        await use(table, "b")
        await use(table, "c")            # a evicted
        files["/a"] = "a2"               # retrained in place
        await use(table, "a")
        assert table.config.loras["a"] == "a2"
        assert events == ["add a1", "add b1", "retire a1", "add c1", "retire b1", "add a2"]
    asyncio.run(story())
