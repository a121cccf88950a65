"""The model registry: models, versions, routing pointers (live, previous, canary), deployments
and releases, every write a compare-and-set (contract: base.py; CAS rules: cas.py).

    create_model_registry("memory://")                 one process (tests); a fresh one per call
    create_model_registry("sqlite:///abs/path.db")     one machine, many processes (`strata up`;
                                                       may share the instance registry's file)
    create_model_registry("redis://127.0.0.1:6379/0")  many machines

The backend is chosen through the stores' scheme table (strata/state/urls.py: the instance
registry's schemes, so one URL names both); each backend module has `from_url(url, options)`.
"""

from __future__ import annotations

import time

from strata.clock import Clock
from strata.registry.models.base import (
    ConflictError,
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRegistryOptions,
    ModelRouting,
    ModelVersion,
    PoolSize,
    Release,
    ReleaseState,
    Strategy,
    split_model_version,
)
from strata.state.urls import backend_module


def create_model_registry(url: str, *, clock: Clock = time.time) -> ModelRegistry:
    """The backend named by `url`'s scheme; `clock` stamps created_at / updated_at."""
    options = ModelRegistryOptions(clock=clock)
    registry: ModelRegistry = backend_module("model_registry", url).from_url(url, options)
    return registry


__all__ = ["ConflictError", "Deployment", "DeploymentState", "ModelRegistry",
           "ModelRegistryOptions", "ModelRouting", "ModelVersion", "PoolSize", "Release",
           "ReleaseState", "Strategy", "create_model_registry", "split_model_version"]
