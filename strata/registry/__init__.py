"""The registry: where instances announce themselves and routers find them (instances/), the
control plane's models, versions, routing pointers, deployments (models/) and the releases that
move them (releases/); leases.py is the one-holder lease both the release controller and the
autoscaler take. One URL names both registries:

    create_registry("memory://")                 one process (tests)
    create_registry("sqlite:///abs/path.db")     one machine, many processes (`strata up`)
    create_registry("redis://127.0.0.1:6379/0")  many machines
"""

from __future__ import annotations

from strata.registry.instances import (
    InstanceLoad,
    InstanceRecord,
    InstanceState,
    Registry,
    RegistryError,
    Role,
    create_registry,
)
from strata.registry.models import create_model_registry

__all__ = ["InstanceLoad", "InstanceRecord", "InstanceState", "Registry", "RegistryError", "Role",
           "create_model_registry", "create_registry"]
