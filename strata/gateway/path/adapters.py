"""Adapter version routing: a request for a registered LoRA adapter goes to one version of it,
sent under that version's own name, which is all an instance knows it by.

    model: "sql"         the live version (while a canary runs, its weight of requests go to
                         the canary), sent to the instance as `model: "sql@v2"`
    model: "sql@v1"      that version (or `X-Model-Version: v1`); a version the adapter does not
                         have is a 404 that lists its versions, never another version
    no live version      an adapter registered but never released is a 404 that says so
    not loaded           a version no routable instance lists (never released, or retired) is
                         a 503 that says so, not another version

A release loads `sql@v2` on the base's instances with the registered sha256 (the instance
refuses other files: strata/registry/releases/adapter_steps.py), so the version named is the
weights that answer; the answer carries `X-Adapter-Version: sql@v2`. As for a model's live
pointer (versions.py), a flip can reach this gateway before the instances' heartbeats list the
new version: until a routable instance lists it, requests stay on `previous`.

Names that are not registered adapter versions (a model, an adapter given with --lora-modules)
pass through untouched. The routing records come from the VersionRouter's refresh.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.responses import Response

from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.requests import ProxyRequest
from strata.gateway.path.versions import VersionRouter
from strata.gateway.upstream.pools import error_response
from strata.registry.models import ModelRouting

ADAPTER_VERSION_HEADER = "x-adapter-version"
Handler = Callable[[ProxyRequest], Awaitable[Response]]  # as forward.py's


@dataclass(frozen=True, slots=True)
class AdapterChoice:
    """The instance's name for the chosen version (`adapter@version`), or why there is none."""

    lora_name: str = ""
    status_code: int = 200
    reason: str = ""


class AdapterRouter:
    """Chooses adapter versions over the routing records the VersionRouter last read."""

    def __init__(self, versions: VersionRouter, rng: random.Random | None = None) -> None:
        self.versions = versions
        self.rng = rng or random.Random()

    def choose(self, model: str | None, version: str | None) -> AdapterChoice | None:
        """None when `model` is not a registered adapter (the request passes untouched)."""
        known = self.versions.adapter_versions.get(model or "")
        if model is None or known is None:
            return None
        if version is not None and version not in known:
            return AdapterChoice(status_code=404, reason=(
                f"Version `{version}` of adapter `{model}` does not exist; versions: "
                f"{', '.join(sorted(known))}"))
        if version is None:
            routing = self.versions.adapters.get(model)
            if routing is None or routing.live is None:
                return AdapterChoice(status_code=404, reason=(
                    f"Adapter `{model}` has no live version yet; release one with `strata "
                    f"release {model}@VERSION` (versions: {', '.join(sorted(known))})"))
            version = self._version(routing)
        chosen = version
        if not self._listed(f"{model}@{chosen}"):
            return AdapterChoice(status_code=503, reason=(
                f"Adapter version `{model}@{chosen}` is loaded on no ready instance (only a "
                "released version is; a release may be loading it now)"))
        return AdapterChoice(f"{model}@{chosen}")

    def _version(self, routing: ModelRouting) -> str:
        def listed(version: str | None) -> bool:
            return version is not None and self._listed(f"{routing.name}@{version}")

        if routing.canary is not None and listed(routing.canary) \
                and self.rng.random() < routing.canary_weight:
            return routing.canary
        live = routing.live
        assert live is not None
        if not listed(live) and listed(routing.previous):
            return routing.previous or live
        return live

    def _listed(self, lora_name: str) -> bool:
        return self.versions.lists(lora_name)


class ChooseAdapter:
    """The path step: the body's `model` becomes the chosen adapter version's name, and the
    answer says which version computed it."""

    def __init__(self, router: AdapterRouter, metrics: GatewayMetrics) -> None:
        self.router = router
        self.metrics = metrics

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        route = request.route
        choice = self.router.choose(route.model, route.version)
        if choice is None:
            return await call_next(request)
        if choice.status_code != 200:
            self.metrics.errors.labels(f"adapter_version_{choice.status_code}").inc()
            return error_response(choice.status_code, choice.reason)
        response = await call_next(_as(request, choice.lora_name))
        response.headers[ADAPTER_VERSION_HEADER] = choice.lora_name
        return response


def _as(request: ProxyRequest, lora_name: str) -> ProxyRequest:
    """`request` asking for `lora_name` (the body rewritten; the route's version is the base's,
    left to the version step)."""
    body = dict(request.body_json or json.loads(request.body or b"{}"))
    body["model"] = lora_name
    route = dataclasses.replace(request.route, model=lora_name, version=None)
    return dataclasses.replace(request, body=json.dumps(body).encode(), body_json=body,
                               route=route)

__all__ = ["ADAPTER_VERSION_HEADER", "AdapterChoice", "AdapterRouter", "ChooseAdapter"]
