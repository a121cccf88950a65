"""The dashboard's models and releases: versions with their part in routing (live, canary,
previous), desired against running replicas, and the newest release of each model drawn as the
path of its state machine (strata/registry/releases/controller.py).

Without a model registry, the models are what the instances serve, and there are no releases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from strata.gateway.routing.instances import InstanceView
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelRouting,
    ModelVersion,
    Release,
    ReleaseState,
    Strategy,
)

S = ReleaseState
FORWARD = (S.PENDING, S.STARTING, S.WARMING, S.CANARY, S.FLIPPING, S.RETIRING, S.DONE)
BACKWARD = (S.ROLLING_BACK, S.ROLLED_BACK)
PASSED, CURRENT, AHEAD, END = "passed", "current", "ahead", "end"


async def models_and_releases(models: ModelRegistry | None, views: Sequence[InstanceView],
                              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(models, the newest release of each model, newest first)."""
    if models is None:
        return served_models(views), []
    versions = await models.list_versions()
    routings = {r.name: r for r in await models.list_routing()}
    deployments = {(d.name, d.version): d for d in await models.list_deployments()}
    newest: dict[str, Release] = {}
    for release in await models.list_releases():  # oldest first
        newest[release.name] = release
    names = sorted({v.name for v in versions} | set(routings) | {v.model for v in views
                                                                  if v.model})
    rows = [_model(name, [v for v in versions if v.name == name], routings.get(name),
                   deployments, views) for name in names]
    shown = sorted(newest.values(), key=lambda r: r.created_at, reverse=True)
    return rows, [release_json(r) for r in shown]


def served_models(views: Sequence[InstanceView]) -> list[dict[str, Any]]:
    names = sorted({v.model for v in views if v.model})
    return [_model(name, [], None, {}, views) for name in names]


def _model(name: str, registered: list[ModelVersion], routing: ModelRouting | None,
           deployments: dict[tuple[str, str], Deployment],
           views: Sequence[InstanceView]) -> dict[str, Any]:
    mine = [v for v in views if v.model == name]
    uris = {v.version: v.uri for v in registered}
    simulated = {v.version: v.is_simulated for v in registered}
    names = sorted(set(uris) | {v.version for v in mine})
    rows = []
    for version in names:
        deployment = deployments.get((name, version))
        serving = [v for v in mine if v.version == version]
        rows.append({
            "version": version, "uri": uris.get(version), "simulated": simulated.get(version),
            "part": _part(version, routing),
            "desired_replicas": _desired(deployment),
            "deployment": deployment.state.value if deployment is not None else None,
            "num_instances": len(serving),
            "num_routable": sum(v.is_routable for v in serving),
        })
    return {"name": name, "routing": _routing(routing), "versions": rows}


def _part(version: str, routing: ModelRouting | None) -> str | None:
    """The version's part in routing: live, canary, previous or None."""
    if routing is None:
        return None
    parts = {routing.live: "live", routing.canary: "canary", routing.previous: "previous"}
    parts.pop(None, None)
    return parts.get(version)


def _desired(deployment: Deployment | None) -> int | None:
    if deployment is None:
        return None
    return deployment.replicas if deployment.state is DeploymentState.ACTIVE else 0


def _routing(routing: ModelRouting | None) -> dict[str, Any] | None:
    if routing is None:
        return None
    return {"live": routing.live, "previous": routing.previous, "canary": routing.canary,
            "canary_weight": routing.canary_weight, "updated_at": routing.updated_at}


def release_json(release: Release) -> dict[str, Any]:
    return {
        "release_id": release.release_id, "name": release.name,
        "from_version": release.from_version, "to_version": release.to_version,
        "strategy": release.strategy.value, "canary_weight": release.canary_weight,
        "replicas": release.replicas, "state": release.state.value, "reason": release.reason,
        "is_terminal": release.is_terminal, "created_at": release.created_at,
        "updated_at": release.updated_at, "stats": dict(release.stats),
        "steps": release_steps(release),
    }


def release_steps(release: Release) -> list[dict[str, Any]]:
    """The release's path through its state machine: the states it passed (with when each was
    entered), the one it is in, and those still ahead on the way it is going. A blue-green
    release has no canary step; a rollback leaves the forward path where it turned back."""
    entered: dict[str, float] = {}
    for state, at in release.history:
        entered.setdefault(state, at)
    path = [s for s in FORWARD if s is not S.CANARY or release.strategy is Strategy.CANARY]
    is_failed = release.state is S.FAILED
    if is_failed or release.state in BACKWARD or any(s.value in entered for s in BACKWARD):
        back = [s for s in BACKWARD if s.value in entered or not is_failed]
        path = [s for s in path if s.value in entered] + back + ([S.FAILED] if is_failed else [])
    steps = []
    for state in path:
        if state is release.state:
            status = END if release.is_terminal else CURRENT
        else:
            status = PASSED if state.value in entered else AHEAD
        steps.append({"state": state.value, "status": status,
                      "entered_at": entered.get(state.value)})
    return steps


__all__ = ["models_and_releases", "release_json", "release_steps", "served_models"]
