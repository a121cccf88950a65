"""Every deployment is pooled: a deployment given only `replicas` is one mixed pool, `replicas`
is the sum of the pools, they survive JSON, and a record written before pools existed reads as
one mixed pool."""

from __future__ import annotations

import pytest

from strata.errors import ConfigError
from strata.registry.models import Deployment, PoolSize


def test_pools_round_trip_through_json_and_name_themselves() -> None:
    d = Deployment("m", "v1", pools=(PoolSize("prefill", replicas=1),
                                     PoolSize("decode", "fast", 2)))
    assert d.replicas == 3
    assert Deployment.from_json(d.to_json()) == d
    assert [p.label for p in d.pools] == ["prefill", "decode.fast"]


def test_a_deployment_of_replicas_is_one_mixed_pool_and_an_old_record_reads_so() -> None:
    plain = Deployment("m", "v1", 2)
    assert plain.pools == (PoolSize(replicas=2),)
    assert plain.to_json()["pools"] == [{"role": "mixed", "pool": "default", "replicas": 2}]
    old = {"name": "m", "version": "v1", "replicas": 2, "state": "active", "revision": 4}
    assert Deployment.from_json(old) == Deployment("m", "v1", 2, revision=4)
    assert Deployment("m", "v1", 0).pools == (PoolSize(replicas=0),)


def test_replicas_must_be_the_sum_of_the_pools_and_labels_unique() -> None:
    with pytest.raises(ConfigError, match="sum of its pools' \\(prefill=1, decode=1\\)"):
        Deployment("m", "v1", 3, pools=(PoolSize("prefill", replicas=1),
                                        PoolSize("decode", replicas=1)))
    with pytest.raises(ConfigError, match="two pools"):
        Deployment("m", "v1", 2, pools=(PoolSize(replicas=1), PoolSize(replicas=1)))
    with pytest.raises(ConfigError, match="role is one of"):
        PoolSize("verify")


def test_resizing_a_pool_and_resizing_the_deployment() -> None:
    plain = Deployment("m", "v1", 2)
    assert plain.with_pool_sizes([PoolSize(replicas=5)]) == Deployment("m", "v1", 5)
    pooled = Deployment("m", "v1", pools=(PoolSize("prefill", replicas=1),
                                          PoolSize("decode", replicas=1)))
    grown = pooled.with_pool_sizes([PoolSize("prefill", replicas=3),
                                    PoolSize("decode", replicas=1)])
    assert (grown.replicas, grown.pools[0].replicas) == (4, 3)
    assert pooled.resized(4) == Deployment("m", "v1", 4)
