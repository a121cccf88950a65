"""`AdapterRouter` (strata/gateway/path/adapters.py) over routing records read from an
in-memory model registry and fake instance views: a registered adapter goes to its live
version under that version's name, a canary takes its weight, a flip not yet listed by any
instance stays on `previous`; a named version is that one, a version the adapter lacks is a 404
that lists them, one no instance lists a 503; names that are not registered adapters pass."""

from __future__ import annotations

import asyncio
import random

from strata.gateway.path.adapters import AdapterChoice, AdapterRouter
from strata.gateway.path.versions import VersionRouter
from strata.gateway.routing.instances import InstanceSet, InstanceView, ReportedLoad
from strata.protocol.lora import AdapterResidency
from strata.registry.models import ModelRouting, ModelVersion, create_model_registry


def instance(iid: str, *lists: str) -> InstanceView:
    adapters = {name: AdapterResidency(name, "d") for name in lists}
    return InstanceView(iid, f"http://{iid}", "tiny", "v1", reported=ReportedLoad(
        adapters=adapters))


def router(routing: ModelRouting, *views: InstanceView, seed: int = 0) -> AdapterRouter:
    async def read() -> VersionRouter:
        models = create_model_registry("memory://")
        await models.add_version(ModelVersion("tiny", "v1", "/m/tiny"))
        for v in ("v1", "v2", "v3"):
            await models.add_version(ModelVersion("sql", v, f"/a/{v}", v[-1] * 64, base="tiny"))
        await models.set_routing(routing, expected_revision=0)
        versions = VersionRouter(models, InstanceSet(views), None)
        await versions.refresh()
        return versions
    versions = asyncio.run(read())
    assert "sql" not in versions.routing  # a model's version step never sees the adapter
    return AdapterRouter(versions, random.Random(seed))


def test_live_canary_and_a_flip_not_listed_yet() -> None:
    both = instance("i-0", "sql@v1", "sql@v2")
    r = router(ModelRouting("sql", live="v2", previous="v1"), both)
    assert r.choose("sql", None) == AdapterChoice("sql@v2")
    assert r.choose("tiny", None) is None and r.choose("other", None) is None
    early = router(ModelRouting("sql", live="v2", previous="v1"), instance("i-0", "sql@v1"))
    assert early.choose("sql", None) == AdapterChoice("sql@v1")  # v2 not listed here yet
    canary = router(ModelRouting("sql", live="v1", canary="v2", canary_weight=0.25), both)
    picks = [canary.choose("sql", None) for _ in range(2000)]
    share = sum(p == AdapterChoice("sql@v2") for p in picks) / len(picks)
    assert 0.2 < share < 0.3 and {p.lora_name for p in picks if p} == {"sql@v1", "sql@v2"}


def test_named_versions_unknown_ones_and_ones_loaded_nowhere() -> None:
    r = router(ModelRouting("sql", live="v2", previous="v1"), instance("i-0", "sql@v2"))
    assert r.choose("sql", "v2") == AdapterChoice("sql@v2")
    unknown = r.choose("sql", "v9")
    assert unknown is not None and unknown.status_code == 404
    assert unknown.reason.endswith("versions: v1, v2, v3")
    nowhere = r.choose("sql", "v1")
    assert nowhere is not None and nowhere.status_code == 503 and "sql@v1" in nowhere.reason
    never = router(ModelRouting("sql"), instance("i-0"))
    choice = never.choose("sql", None)
    assert choice is not None and choice.status_code == 404 and "no live version" in choice.reason
