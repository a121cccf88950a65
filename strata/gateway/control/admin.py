"""The control-plane admin API of a gateway with a model registry (behind its API keys).

    GET  /admin/models                      every model: routing pointer, versions, instances,
                                            and its LoRA adapters (each with its own routing
                                            pointer and versions, and the instances listing
                                            each version)
    POST /admin/models                      register name@version -> URI (201; 409 if it differs;
                                            400 for a URI outside --model-root or a flag
                                            outside the table: control/intake.py); with
                                            `base`, a LoRA adapter version of that model
                                            (control/adapter_intake.py: 404 unknown base, 400
                                            files that do not match the sha256 given)
    POST /admin/releases                    start a release (202); 404 unknown version, 409 busy
    GET  /admin/releases[?model=NAME]       releases, oldest first
    GET  /admin/releases/{release_id}       one release (its state, history and stats)
    POST /admin/models/{name}/rollback      roll back (202): the release in progress, or back to
                                            the previous version

`strata models`, `strata release` and `strata rollback` are clients of this API, so they work
the same against a local `strata up` cluster and a remote one given its gateway URL.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from strata.errors import ConfigError, ConflictError, RequestError, StrataError
from strata.gateway.control.adapter_intake import check_adapter
from strata.gateway.control.intake import check_serve_args, check_uri
from strata.gateway.control.releases import ReleaseService
from strata.gateway.upstream.pools import error_response
from strata.gateway.wiring import Gateway
from strata.protocol.json_body import parse_json_object
from strata.registry.models import ModelRegistry, ModelVersion, Strategy, split_model_version


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def _body(request: Request) -> dict[str, Any]:
    return parse_json_object(await request.body() or b"{}")


def _failure(exc: Exception) -> Response:
    if isinstance(exc, ConflictError):
        return error_response(409, str(exc), kind="conflict_error")
    if isinstance(exc, RequestError):
        return error_response(exc.status_code, str(exc))
    if isinstance(exc, (ConfigError, ValueError, KeyError, TypeError)):
        return error_response(400, str(exc) if not isinstance(exc, KeyError)
                              else f"missing field {exc}")
    return error_response(503, f"the registry failed: {exc}")


Handler = Callable[[Request, ModelRegistry, ReleaseService], Awaitable[Response]]


def _control_plane(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The route over this gateway's model registry and release service: a 400 when it has
    none, and every refusal as an OpenAI error body (409 for a lost compare-and-set)."""
    async def route(request: Request) -> Response:
        gateway = _gateway(request)
        if gateway.models is None or gateway.releases is None:
            return error_response(400, "this gateway has no model registry (start it with "
                                       "--registry sqlite:///... or redis://...)")
        try:
            return await handler(request, gateway.models, gateway.releases)
        except (StrataError, ValueError, KeyError, TypeError) as exc:
            return _failure(exc)

    return route


@_control_plane
async def list_models(request: Request, models: ModelRegistry,
                      releases: ReleaseService) -> Response:
    routings = {r.name: r for r in await models.list_routing()}
    views = _gateway(request).source.instances.snapshot()
    entries: dict[str, dict[str, Any]] = {}
    adapters: dict[str, dict[str, Any]] = {}
    for v in await models.list_versions():
        table = adapters if v.is_adapter else entries
        entry = table.setdefault(v.name, {"name": v.name, "routing": None, "versions": []})
        serving = [x.instance_id for x in views if x.is_routable and (
            x.serves(v.key) if v.is_adapter else x.model == v.name and x.version == v.version)]
        entry["versions"].append(v.to_json() | {"routable_instances": serving})
        if v.is_adapter:
            entry["base"] = v.base
    for name, routing in routings.items():
        table = adapters if name in adapters else entries
        table.setdefault(name, {"name": name, "versions": []})["routing"] = routing.to_json()
    for name in sorted(adapters):
        base = entries.setdefault(adapters[name]["base"], {"name": adapters[name]["base"],
                                                           "routing": None, "versions": []})
        base.setdefault("adapters", []).append(adapters[name])
    return JSONResponse({"models": [entries[name] for name in sorted(entries)]})


@_control_plane
async def add_model(request: Request, models: ModelRegistry,
                    releases: ReleaseService) -> Response:
    data = await _body(request)
    version = ModelVersion(
        name=str(data["name"]), version=str(data["version"]), uri=str(data["uri"]),
        manifest_sha256=str(data.get("manifest_sha256") or ""),
        serve_args=tuple(str(a) for a in data.get("serve_args") or ()), created_at=time.time(),
        base=str(data.get("base") or ""))
    check_uri(version.uri, _gateway(request).config.model_roots)
    check_serve_args(version.serve_args)
    if version.is_adapter:
        version = await check_adapter(version, models)
    elif version.name in {v.name for v in await models.list_versions() if v.is_adapter}:
        raise ConflictError(f"{version.name!r} is a LoRA adapter's name; a model needs its own")
    stored = await models.add_version(version)
    return JSONResponse(stored.to_json(), status_code=201)


@_control_plane
async def start_release(request: Request, models: ModelRegistry,
                        releases: ReleaseService) -> Response:
    data = await _body(request)
    name, version = split_model_version(str(data["model"]))
    if version is None:
        raise ConfigError("model must be NAME@VERSION: the version to release")
    replicas = data.get("replicas")
    release = await releases.start(
        name, version, strategy=Strategy(data.get("strategy", Strategy.BLUE_GREEN.value)),
        canary_weight=float(data.get("canary_weight", 0.1)),
        replicas=None if replicas is None else int(replicas))
    return JSONResponse(release.to_json(), status_code=202)


@_control_plane
async def list_releases(request: Request, models: ModelRegistry,
                        releases: ReleaseService) -> Response:
    found = await models.list_releases(request.query_params.get("model"))
    return JSONResponse({"releases": [r.to_json() for r in found]})


@_control_plane
async def get_release(request: Request, models: ModelRegistry,
                      releases: ReleaseService) -> Response:
    release_id = request.path_params["release_id"]
    release = await models.get_release(release_id)
    if release is None:
        return error_response(404, f"no release {release_id!r}; see GET /admin/releases")
    return JSONResponse(release.to_json())


@_control_plane
async def rollback(request: Request, models: ModelRegistry,
                   releases: ReleaseService) -> Response:
    release = await releases.rollback(request.path_params["name"])
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
