"""What `strata up` writes into the registry before it starts anything (memory registries), and
how it names the flags' model (the `strata up` parser)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from strata.cli import build_parser
from strata.cluster.seed import ClusterSeed, seed_registry
from strata.commands.up import seed_version
from strata.errors import ConfigError
from strata.registry import InstanceRecord, InstanceState, create_registry
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
    create_model_registry,
)
from strata.store.manifest import write_manifest

V1 = ModelVersion("m", "v1", "sim:smollm2-cpu")
V2 = ModelVersion("m", "v2", "sim:smollm2-cpu", serve_args=("--max-num-seqs", "4"))


def test_a_fresh_registry_gets_the_version_its_deployment_and_the_live_pointer() -> None:
    async def story() -> None:
        models, instances = create_model_registry("memory://"), create_registry("memory://")
        stored = await seed_registry(models, instances, ClusterSeed(V1, replicas=3), now=10.0)
        assert stored.key == "m@v1" and stored.uri == "sim:smollm2-cpu"
        assert [(d.key, d.replicas, d.state) for d in await models.list_deployments()] == [
            ("m@v1", 3, DeploymentState.ACTIVE)]
        routing = await models.get_routing("m")
        assert routing is not None and (routing.live, routing.previous) == ("v1", None)

    asyncio.run(story())


def test_a_restart_keeps_the_catalogue_and_re_seeds_the_run_state() -> None:
    async def story() -> None:
        models, instances = create_model_registry("memory://"), create_registry("memory://")
        await seed_registry(models, instances, ClusterSeed(V1, replicas=2), now=10.0)
        # what the previous run left: a v2 release half done, instances, other routing
        await models.add_version(V2)
        await models.put_deployment(Deployment("m", "v2", 1), expected_revision=0)
        release = await models.put_release(
            Release("r1", "m", "v2", "v1", state=ReleaseState.WARMING, owner="gw-1",
                    lease_until=99.0), expected_revision=0)
        other = ModelVersion("other", "x", "sim:smollm2-cpu")
        await models.add_version(other)
        await models.set_routing(ModelRouting("other", live="x"), expected_revision=0)
        await models.add_version(ModelVersion("sql", "a1", "/adapters/sql", "0" * 64, base="m"))
        await models.set_routing(ModelRouting("sql", live="a1"), expected_revision=0)
        await instances.register(InstanceRecord("m-v1-0", "http://127.0.0.1:1", "m", "v1",
                                                state=InstanceState.READY))

        await seed_registry(models, instances, ClusterSeed(V1, replicas=1), now=20.0)
        assert [v.key for v in await models.list_versions()] == ["m@v1", "m@v2", "other@x",
                                                                 "sql@a1"]
        assert [(d.key, d.replicas) for d in await models.list_deployments()] == [("m@v1", 1)]
        assert await instances.list_instances() == []
        failed = await models.get_release("r1")
        assert failed is not None and failed.state is ReleaseState.FAILED
        assert (failed.reason, failed.owner, failed.revision) == (
            "cluster restarted", "", release.revision + 1)
        assert failed.history[-1] == ("failed", 20.0)
        cleared = await models.get_routing("other")
        assert cleared is not None and cleared.live is None
        adapter = await models.get_routing("sql")  # the gateways load it on the new instances
        assert adapter is not None and adapter.live == "a1"
        routing = await models.get_routing("m")
        assert routing is not None and routing.live == "v1"

    asyncio.run(story())


def test_a_restart_with_another_uri_under_the_same_version_says_to_pick_another() -> None:
    async def story() -> None:
        models, instances = create_model_registry("memory://"), create_registry("memory://")
        await seed_registry(models, instances, ClusterSeed(V1, replicas=1))
        moved = ModelVersion("m", "v1", "/models/elsewhere")
        with pytest.raises(ConfigError, match="pick another --model-version") as caught:
            await seed_registry(models, instances, ClusterSeed(moved, replicas=1))
        assert "'sim:smollm2-cpu'" in str(caught.value)
        assert [d.key for d in await models.list_deployments()] == ["m@v1"]  # untouched

    asyncio.run(story())


def up_args(*argv: str) -> ModelVersion:
    return seed_version(build_parser().parse_args(["up", *argv]))


def test_the_seeded_name_is_the_one_strata_serve_would_serve(tmp_path: Path) -> None:
    assert up_args() == ModelVersion("SmolLM2-135M-Instruct", "default", "smollm2")
    assert up_args("--simulate", "smollm2-cpu", "--model-version", "v3") == ModelVersion(
        "SmolLM2-135M-Instruct", "v3", "sim:smollm2-cpu")
    assert up_args("--simulate", "smollm2-cpu", "--served-model-name", "s").name == "s"
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert up_args(str(model_dir)) == ModelVersion("my-model", "default", str(model_dir))
    manifest = write_manifest(model_dir)
    assert up_args(str(model_dir)).manifest_sha256 == hashlib.sha256(
        manifest.read_bytes()).hexdigest()
    assert up_args("s3://bucket/models/tiny/").name == "tiny"


def test_gateway_flags_pass_through_and_version_flags_stay_with_the_version(
    tmp_path: Path,
) -> None:
    from strata.commands.env import CliEnv
    from strata.commands.up import _config

    args = build_parser().parse_args(
        ["up", "--simulate", "smollm2-cpu", "--model-version", "v1", "--dtype", "float32",
         "--policy", "least_load", "--gateway-arg=--max-in-flight=8", "--gateway-arg=--x"])
    config = _config(args, CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run"))
    assert config.gateway_args == ("--policy", "least_load", "--max-in-flight=8", "--x")
    assert config.serve_args == ("--log-level", "warning", "--dtype", "float32")
