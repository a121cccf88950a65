"""The control-plane admin API of a gateway with a model registry (behind its API keys).

    GET  /admin/models                      every model: routing pointer, versions, instances
    POST /admin/models                      register name@version -> URI (201; 409 if it differs)
    POST /admin/releases                    start a release (202); 404 unknown version, 409 busy
    GET  /admin/releases[?model=NAME]       releases, oldest first
    GET  /admin/releases/{release_id}       one release (its state, history and stats)
    POST /admin/models/{name}/rollback      roll back (202): the release in progress, or back to
                                            the previous version

`strata models`, `strata release` and `strata rollback` are clients of this API, so they work
the same against a local `strata up` cluster and a remote one given its gateway URL.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata.errors import ConfigError, RequestError, StrataError
from strata.gateway.components import Gateway
from strata.gateway.upstream import error_response
from strata.registry.models import ConflictError, ModelVersion, Strategy, split_model_version


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _body(request: Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("request body must be a JSON object")
    return data


def _failure(exc: Exception) -> Response:
    if isinstance(exc, ConflictError):
        return error_response(409, str(exc), kind="conflict_error")
    if isinstance(exc, RequestError):
        return error_response(exc.status_code, str(exc))
    if isinstance(exc, (ConfigError, ValueError, KeyError, TypeError)):
        return error_response(400, str(exc) if not isinstance(exc, KeyError)
                              else f"missing field {exc}")
    return error_response(503, f"the registry failed: {exc}")


def _requires_registry(gateway: Gateway) -> Response | None:
    if gateway.models is None or gateway.releases is None:
        return error_response(400, "this gateway has no model registry (start it with "
                                   "--registry sqlite:///... or redis://...)")
    return None


async def list_models(request: Request) -> Response:
    gateway = _gateway(request)
    if (refused := _requires_registry(gateway)) is not None:
        return refused
    assert gateway.models is not None
    try:
        routings = {r.name: r for r in await gateway.models.list_routing()}
        versions = await gateway.models.list_versions()
    except StrataError as exc:
        return _failure(exc)
    views = gateway.source.instances.snapshot()
    models: dict[str, dict[str, Any]] = {}
    for v in versions:
        entry = models.setdefault(v.name, {"name": v.name, "routing": None, "versions": []})
        serving = [x.instance_id for x in views if x.model == v.name and x.version == v.version
                   and x.is_routable]
        entry["versions"].append(v.to_json() | {"routable_instances": serving})
    for name, routing in routings.items():
        models.setdefault(name, {"name": name, "versions": []})["routing"] = routing.to_json()
    return JSONResponse({"models": [models[name] for name in sorted(models)]})


async def add_model(request: Request) -> Response:
    gateway = _gateway(request)
    if (refused := _requires_registry(gateway)) is not None:
        return refused
    assert gateway.models is not None
    try:
        data = await _body(request)
        version = ModelVersion(
            name=str(data["name"]), version=str(data["version"]), uri=str(data["uri"]),
            manifest_sha256=str(data.get("manifest_sha256") or ""),
            serve_args=tuple(str(a) for a in data.get("serve_args") or ()),
            created_at=time.time())
        stored = await gateway.models.add_version(version)
    except (StrataError, ValueError, KeyError, TypeError) as exc:
        return _failure(exc)
    return JSONResponse(stored.to_json(), status_code=201)


async def start_release(request: Request) -> Response:
    gateway = _gateway(request)
    if (refused := _requires_registry(gateway)) is not None:
        return refused
    assert gateway.releases is not None
    try:
        data = await _body(request)
        name, version = split_model_version(str(data["model"]))
        if version is None:
            raise ConfigError("model must be NAME@VERSION: the version to release")
        replicas = data.get("replicas")
        release = await gateway.releases.start(
            name, version, strategy=Strategy(data.get("strategy", Strategy.BLUE_GREEN.value)),
            canary_weight=float(data.get("canary_weight", 0.1)),
            replicas=None if replicas is None else int(replicas))
    except (StrataError, ValueError, KeyError, TypeError) as exc:
        return _failure(exc)
    return JSONResponse(release.to_json(), status_code=202)


async def list_releases(request: Request) -> Response:
    gateway = _gateway(request)
    if (refused := _requires_registry(gateway)) is not None:
        return refused
    assert gateway.models is not None
    try:
        releases = await gateway.models.list_releases(request.query_params.get("model"))
    except StrataError as exc:
        return _failure(exc)
    return JSONResponse({"releases": [r.to_json() for r in releases]})


async def get_release(request: Request) -> Response:
    gateway = _gateway(request)
    if (refused := _requires_registry(gateway)) is not None:
        return refused
    assert gateway.models is not None
    release_id = request.path_params["release_id"]
    try:
        release = await gateway.models.get_release(release_id)
    except StrataError as exc:
        return _failure(exc)
    if release is None:
        return error_response(404, f"no release {release_id!r}; see GET /admin/releases")
    return JSONResponse(release.to_json())


async def rollback(request: Request) -> Response:
    gateway = _gateway(request)
    if (refused := _requires_registry(gateway)) is not None:
        return refused
    assert gateway.releases is not None
    try:
        release = await gateway.releases.rollback(request.path_params["name"])
    except (StrataError, ValueError) as exc:
        return _failure(exc)
    return JSONResponse(release.to_json(), status_code=202)


def admin_routes() -> list[Route]:
    return [
        Route("/admin/models", list_models, methods=["GET"]),
        Route("/admin/models", add_model, methods=["POST"]),
        Route("/admin/models/{name}/rollback", rollback, methods=["POST"]),
        Route("/admin/releases", list_releases, methods=["GET"]),
        Route("/admin/releases", start_release, methods=["POST"]),
        Route("/admin/releases/{release_id}", get_release, methods=["GET"]),
    ]


__all__ = ["admin_routes"]
