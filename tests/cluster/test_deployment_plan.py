"""The reconcile plan shared by the launchers: pure stories over deployments and owned slots."""

from __future__ import annotations

from strata.cluster.deployments import (
    Plan,
    Slot,
    Start,
    instance_id_of,
    plan,
    serve_model_args,
    without_version_flags,
)
from strata.registry.models import Deployment, DeploymentState, ModelVersion, PoolSize

V1 = ModelVersion("m", "v1", "/models/m1")
V2 = ModelVersion("m", "v2", "sim:smollm2-cpu", serve_args=("--max-num-seqs", "8"))
VERSIONS = {V1.key: V1, V2.key: V2}
RETIRING = DeploymentState.RETIRING


def test_instance_ids_are_per_version_and_safe_in_urls_and_paths() -> None:
    assert instance_id_of("m", "v1", 0) == "m-v1-0"
    assert instance_id_of("org/My Model", "2024.1", 3) == "org-My-Model-2024.1-3"


def test_an_active_deployment_starts_its_missing_replicas_lowest_index_first() -> None:
    owned = {"m-v1-1": Slot("m@v1", 1)}
    assert plan([Deployment("m", "v1", 3)], VERSIONS, owned) == Plan(
        start=(Start(V1, 0), Start(V1, 2)))


def test_scaling_down_drains_the_highest_indices_once() -> None:
    owned = {f"m-v1-{i}": Slot("m@v1", i) for i in range(3)}
    assert plan([Deployment("m", "v1", 1)], VERSIONS, owned) == Plan(drain=("m-v1-1", "m-v1-2"))
    owned["m-v1-1"] = Slot("m@v1", 1, is_draining=True)
    owned["m-v1-2"] = Slot("m@v1", 2, is_draining=True)
    assert plan([Deployment("m", "v1", 1)], VERSIONS, owned).is_empty


def test_a_draining_id_is_not_reused_until_it_has_exited() -> None:
    """A draining instance counts for nothing: its replacement starts at once, under an id no
    process holds; the draining one's id is free again once it has exited."""
    owned = {"m-v1-0": Slot("m@v1", 0), "m-v1-1": Slot("m@v1", 1, is_draining=True)}
    assert plan([Deployment("m", "v1", 2)], VERSIONS, owned) == Plan(start=(Start(V1, 2),))
    del owned["m-v1-1"]
    assert plan([Deployment("m", "v1", 2)], VERSIONS, owned) == Plan(start=(Start(V1, 1),))


def test_a_retiring_deployment_drains_all_then_is_deleted_once_nothing_is_left() -> None:
    v1_retiring = Deployment("m", "v1", 2, state=RETIRING, revision=3)
    deployments = [v1_retiring, Deployment("m", "v2", 1)]
    owned = {"m-v1-0": Slot("m@v1", 0), "m-v1-1": Slot("m@v1", 1), "m-v2-0": Slot("m@v2", 0)}
    assert plan(deployments, VERSIONS, owned) == Plan(drain=("m-v1-0", "m-v1-1"))
    owned = {"m-v1-1": Slot("m@v1", 1, is_draining=True), "m-v2-0": Slot("m@v2", 0)}
    assert plan(deployments, VERSIONS, owned).is_empty
    del owned["m-v1-1"]
    assert plan(deployments, VERSIONS, owned) == Plan(delete=(v1_retiring,))


def test_an_instance_of_no_deployment_is_drained() -> None:
    owned = {"m-v1-0": Slot("m@v1", 0)}
    assert plan([], VERSIONS, owned) == Plan(drain=("m-v1-0",))


def test_a_version_missing_from_the_catalogue_starts_nothing_and_stops_nothing() -> None:
    owned = {"x-v9-0": Slot("x@v9", 0)}
    assert plan([Deployment("x", "v9", 2)], VERSIONS, owned) == Plan(missing_versions=("x@v9",))


def pd(prefill: int, decode: int) -> Deployment:
    return Deployment("m", "v1", prefill + decode, pools=(
        PoolSize("prefill", replicas=prefill), PoolSize("decode", replicas=decode)))


def test_a_pooled_deployment_starts_each_pool_at_the_lowest_free_indices_in_pool_order() -> None:
    assert plan([pd(1, 2)], VERSIONS, {}) == Plan(start=(
        Start(V1, 0, "prefill"), Start(V1, 1, "decode"), Start(V1, 2, "decode")))


def test_growing_one_pool_leaves_the_other_pools_instances_where_they_are() -> None:
    owned = {"m-v1-0": Slot("m@v1", 0, role="prefill"), "m-v1-1": Slot("m@v1", 1, role="decode"),
             "m-v1-2": Slot("m@v1", 2, role="decode")}
    assert plan([pd(2, 2)], VERSIONS, owned) == Plan(start=(Start(V1, 3, "prefill"),))
    assert plan([pd(1, 3)], VERSIONS, owned) == Plan(start=(Start(V1, 3, "decode"),))


def test_shrinking_a_pool_drains_its_highest_index_and_nothing_else() -> None:
    owned = {"m-v1-0": Slot("m@v1", 0, role="prefill"), "m-v1-1": Slot("m@v1", 1, role="decode"),
             "m-v1-2": Slot("m@v1", 2, role="decode"), "m-v1-3": Slot("m@v1", 3, role="prefill")}
    assert plan([pd(2, 1)], VERSIONS, owned) == Plan(drain=("m-v1-2",))
    owned["m-v1-2"] = Slot("m@v1", 2, is_draining=True, role="decode")
    assert plan([pd(2, 1)], VERSIONS, owned).is_empty
    # growing back does not wait for the drain, nor reuse its id
    assert plan([pd(2, 2)], VERSIONS, owned) == Plan(start=(Start(V1, 4, "decode"),))


def test_a_class_pool_is_its_own_pool_and_a_pool_no_longer_listed_is_drained() -> None:
    fast = Deployment("m", "v1", 2, pools=(PoolSize(replicas=1), PoolSize(pool="fast", replicas=1)))
    assert plan([fast], VERSIONS, {}) == Plan(start=(Start(V1, 0, "mixed"),
                                                    Start(V1, 1, "mixed", "fast")))
    owned = {"m-v1-0": Slot("m@v1", 0), "m-v1-1": Slot("m@v1", 1, pool="fast")}
    only_default = Deployment("m", "v1", 1, pools=(PoolSize(replicas=1),))
    assert plan([only_default], VERSIONS, owned) == Plan(drain=("m-v1-1",))


def test_serve_args_come_from_the_version_then_the_cluster_then_the_version_extras() -> None:
    cluster = ["--simulate", "other", "--dtype", "float32", "--model-version=old",
               "--served-model-name", "n", "--log-level", "warning"]
    assert serve_model_args(V1, cluster) == [
        "/models/m1", "--served-model-name", "m", "--model-version", "v1",
        "--dtype", "float32", "--log-level", "warning"]
    assert serve_model_args(V2, ["--kv-cache-gb", "0.1"]) == [
        "--simulate", "smollm2-cpu", "--served-model-name", "m", "--model-version", "v2",
        "--kv-cache-gb", "0.1", "--max-num-seqs", "8"]
    assert without_version_flags(["--simulate=p", "--block-size", "16"]) == ["--block-size", "16"]
