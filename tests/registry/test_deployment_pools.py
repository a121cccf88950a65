"""A deployment's pools: their sum is its replicas, they survive JSON, and resizing one pool
keeps an unpooled deployment unpooled."""

from __future__ import annotations

import pytest

from strata.errors import ConfigError
from strata.registry.models import Deployment, PoolSize


def test_pools_round_trip_through_json_and_name_themselves() -> None:
    d = Deployment("m", "v1", 3, pools=(PoolSize("prefill", replicas=1),
                                        PoolSize("decode", "fast", 2)))
    assert Deployment.from_json(d.to_json()) == d
    assert [p.label for p in d.pool_sizes] == ["prefill", "decode.fast"]
    assert "pools" not in Deployment("m", "v1", 2).to_json()  # unpooled records stay as they were


def test_replicas_must_be_the_sum_of_the_pools_and_labels_unique() -> None:
    with pytest.raises(ConfigError, match="sum of its pools' \\(prefill=1, decode=1\\)"):
        Deployment("m", "v1", 3, pools=(PoolSize("prefill", replicas=1),
                                        PoolSize("decode", replicas=1)))
    with pytest.raises(ConfigError, match="two pools"):
        Deployment("m", "v1", 2, pools=(PoolSize(replicas=1), PoolSize(replicas=1)))
    with pytest.raises(ConfigError, match="role is one of"):
        PoolSize("verify")


def test_resizing_keeps_an_unpooled_deployment_unpooled() -> None:
    plain = Deployment("m", "v1", 2)
    assert plain.pool_sizes == (PoolSize(replicas=2),)
    assert plain.with_pool_sizes([PoolSize(replicas=5)]) == Deployment("m", "v1", 5)
    pooled = Deployment("m", "v1", 2, pools=(PoolSize("prefill", replicas=1),
                                             PoolSize("decode", replicas=1)))
    grown = pooled.with_pool_sizes([PoolSize("prefill", replicas=3),
                                    PoolSize("decode", replicas=1)])
    assert (grown.replicas, grown.pools[0].replicas) == (4, 3)
