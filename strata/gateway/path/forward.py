"""The path of a generation request through the gateway, read top to bottom.

`routes.py` parses what routing needs (a `RouteRequest`) into a `ProxyRequest`, then hands it to
the chain of `path_steps`, which ends in the proxy; each step below wraps the next one:

    MeterTenants    refuses a request over its key's budget (429), then counts the answer's
                    usage for its tenant once it is whole (strata/gateway/tenants/meter.py)
    RouteByClass    with priority classes on: the request's pool by class (spill-over only to
                    pools with room), held while no pool has room, sheddable and then batch
                    refused first (strata/gateway/path/classes.py)
    Admit           an admission slot, held until the answer is fully sent (streams: until
                    they end), by class; a full queue is answered 429/503 at once
    ChooseAdapter   with a model registry: a registered LoRA adapter's version (live, canary,
                    or the one named), sent under that version's name
                    (strata/gateway/path/adapters.py)
    ChooseVersion   with a model registry: the model version (explicit, session, canary, live;
                    strata/gateway/path/versions.py), chosen once more when that version is gone
    CacheAnswers    with a response cache too: a deterministic answer asked again comes from
                    the cache (strata/gateway/path/response_cache.py)
    PlaceSession    with sticky or hybrid session routing: the session is placed (its pin read
                    or written) before routing (strata/gateway/path/sessions.py)
    KeyPrefix       with --policy cache_aware: the prompt's block keys for each candidate ride
                    on the route (strata/gateway/routing/prefix/feed.py)
    HandOff         with the prefill/decode hand-off on: a long prompt is prefilled on a prefill
                    instance, then sent to a decode instance with the handle
                    (strata/gateway/routing/pd.py)
    Proxy.forward   filters -> policy -> send; retries on another instance until the first byte
                    reaches the client (strata/gateway/upstream/proxy.py, pipeline.py, policies/)

With tracing on (strata/tracing/), `chain` puts each step in a span of its own
(`strata.gateway.step.<Step>`), so the trace shows the path as this list; off, nothing is wrapped.

A step whose feature is off is not in the list; no step asks whether a feature is on. A new
feature (prefill/decode hand-off, priority classes) is one more step class and one more line in
`path_steps`. Steps add no work per streamed chunk, but one: the tenants' meter looks for the
usage chunk in each (one regex search; strata/gateway/tenants/usage.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from starlette.responses import Response

from strata import tracing
from strata.errors import OverloadedError
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.path.adapters import AdapterRouter, ChooseAdapter
from strata.gateway.path.admission import Admission
from strata.gateway.path.classes import ClassFlow, RouteByClass
from strata.gateway.path.response_cache import CACHE_HEADER, ResponseCacheLayer, cache_key
from strata.gateway.path.sessions import MOVED_HEADER as SESSION_MOVED_HEADER
from strata.gateway.path.sessions import ROUTING_HEADER, SessionRouter
from strata.gateway.path.versions import CANARY, LIVE, SESSION, VersionChoice, VersionRouter
from strata.gateway.path.versions import MOVED_HEADER as VERSION_MOVED_HEADER
from strata.gateway.routing.pd import PDRouter
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.prefix.feed import PrefixRouting
from strata.gateway.tenants.meter import MeterTenants
from strata.gateway.upstream.pools import INSTANCE_HEADER, RelayResponse, error_response
from strata.gateway.upstream.proxy import Proxy, ProxyRequest

Handler = Callable[[ProxyRequest], Awaitable[Response]]


class Step(Protocol):
    """One feature on the path: does its part, calls `call_next` (zero, one or more times)."""

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response: ...


def path_steps(*, admission: Admission, metrics: GatewayMetrics, proxy: Proxy,
               versions: VersionRouter | None = None, cache: ResponseCacheLayer | None = None,
               sessions: SessionRouter | None = None,
               prefix: PrefixRouting | None = None,
               classes: ClassFlow | None = None, pd: PDRouter | None = None,
               tenants: MeterTenants | None = None) -> list[Step]:
    """The steps before the proxy, outermost first: one per feature that is on. The gateway's
    path is `chain(path_steps(...), proxy.forward)`."""
    steps: list[Step] = [tenants] if tenants is not None else []
    if classes is not None:
        steps.append(RouteByClass(classes, metrics))
    steps.append(Admit(admission, metrics))
    if versions is not None:
        steps.append(ChooseAdapter(AdapterRouter(versions, versions.rng), metrics))
        steps.append(ChooseVersion(versions, metrics))
        if cache is not None:  # a cache key carries the chosen version
            steps.append(CacheAnswers(cache, versions))
    if sessions is not None:
        steps.append(PlaceSession(sessions, proxy.pipeline))
    if prefix is not None:
        steps.append(KeyPrefix(prefix, proxy.pipeline))
    if pd is not None:
        steps.append(HandOff(pd))
    return steps


def chain(steps: Sequence[Step], last: Handler) -> Handler:
    """`steps[0]` wrapping `steps[1]` ... wrapping `last`; with tracing on, each in its span."""
    if tracing.is_on():
        steps = [TracedStep(step) for step in steps]
    handler = last
    for step in reversed(steps):
        handler = functools.partial(step, call_next=handler)
    return handler


class TracedStep:
    """A step inside its own span (tracing on): its attributes are what the step notes."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.name = f"strata.gateway.step.{type(step).__name__}"

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        with tracing.span(self.name):
            return await self.step(request, call_next)


class Admit:
    """Holds an admission slot until the answer is fully sent (a stream: until it ends, however
    it ends); an exception releases it at once."""

    def __init__(self, admission: Admission, metrics: GatewayMetrics) -> None:
        self.admission = admission
        self.metrics = metrics

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        try:
            with tracing.span("strata.gateway.admission_wait"):
                await self.admission.acquire(request.route.priority)
        except OverloadedError as exc:
            self.metrics.errors.labels(f"admission_{exc.status_code}").inc()
            return error_response(exc.status_code, exc.message, retry_after_s=exc.retry_after_s)
        try:
            response = await call_next(request)
        except BaseException:
            self.admission.release()
            raise
        if isinstance(response, RelayResponse):
            response.on_close.append(self.admission.release)
        else:
            self.admission.release()
        return response


class ChooseVersion:
    """Routes the request to one version of its model. When no instance of a version the
    gateway chose (not one the client named) could take it, the gateway's view of a retiring
    version lagged the registry by up to one refresh: a session moves off that version, other
    requests re-read the routing pointers, and the request is sent once more if that names
    another version. A moved session's answer carries `X-Strata-Version-Moved: old->new`."""

    def __init__(self, versions: VersionRouter, metrics: GatewayMetrics) -> None:
        self.versions = versions
        self.metrics = metrics

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        route = request.route
        choice = await self.versions.choose(route.model, route.version, route.session_id)
        if choice.status_code != 200:
            self.metrics.errors.labels(f"version_{choice.status_code}").inc()
            return error_response(choice.status_code, choice.reason,
                                  retry_after_s=choice.retry_after_s)
        response = await call_next(_at_version(request, choice.version))
        if _version_is_gone(choice, response):
            again = await self._choose_again(route, choice)
            if again is not None and again.version != choice.version:
                choice = again
                response = await call_next(_at_version(request, choice.version))
        if choice.moved_from is not None:
            response.headers[VERSION_MOVED_HEADER] = f"{choice.moved_from}->{choice.version}"
        if tracing.is_on():
            tracing.note({"strata.version": choice.version, "strata.version.source":
                          choice.source, "strata.version.moved_from": choice.moved_from})
        return response

    async def _choose_again(self, route: RouteRequest,
                            failed: VersionChoice) -> VersionChoice | None:
        if failed.source == SESSION:
            return await self.versions.choose(route.model, None, route.session_id,
                                              avoid=failed.version)
        try:
            await self.versions.refresh()
        except Exception:  # the registry is down: the answer stands
            return None
        return await self.versions.choose(route.model, None, route.session_id)


def _at_version(request: ProxyRequest, version: str | None) -> ProxyRequest:
    return dataclasses.replace(request, route=dataclasses.replace(request.route, version=version))


def _version_is_gone(choice: VersionChoice, response: Response) -> bool:
    return (choice.source in (SESSION, LIVE, CANARY) and choice.moved_from is None
            and response.status_code in (502, 503) and not isinstance(response, RelayResponse))


class CacheAnswers:
    """Answers a deterministic request (temperature 0 or a seed; not streamed, not a session's
    turn, whose answer depends on the stored history) from the response cache; a miss is
    stored on its way back (`X-Strata-Cache: hit|miss`). Keys carry the chosen version, so
    nothing one version computed answers for another."""

    def __init__(self, cache: ResponseCacheLayer, versions: VersionRouter) -> None:
        self.cache = cache
        self.versions = versions

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        key = self._key(request)
        if key is None:
            return await call_next(request)
        cached = await self.cache.lookup(key)
        if cached is not None:
            model, version = request.route.model or "", request.route.version
            return Response(cached, 200, media_type="application/json",
                            headers={CACHE_HEADER: "hit", "x-model-version": f"{model}@{version}"})
        response = await call_next(request)
        if not isinstance(response, RelayResponse):
            await self.cache.store(key, response.status_code, bytes(response.body))
            response.headers[CACHE_HEADER] = "miss"
        return response

    def _key(self, request: ProxyRequest) -> str | None:
        """None before the body is parsed again for a stream, a session or no known version."""
        route = request.route
        if route.version is None or route.session_id or route.is_stream:
            return None
        routed = self.versions.routing
        model = route.model or (next(iter(routed)) if len(routed) == 1 else None)
        if model is None:
            return None
        body = request.body_json
        if body is None:
            return None
        tenant = ""
        if self.cache.is_per_tenant:
            tenant = request.tenant
        return cache_key(request.path, body, model=model, version=route.version, tenant=tenant)


class PlaceSession:
    """Places a request's session before routing (reading and writing the shared pin store);
    the policy then sends it there (`PinnedSessionPolicy`). The answer carries
    `X-Strata-Session-Routing` (pinned, placed, moved, unpinned or rerouted); in hybrid mode a
    moved session's request and answer carry `X-Strata-Session-Moved: 1`."""

    def __init__(self, sessions: SessionRouter, pipeline: RoutingPipeline) -> None:
        self.sessions = sessions
        self.pipeline = pipeline

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        route = request.route
        if route.session_id is None:
            return await call_next(request)
        candidates = self.pipeline.candidates(route)
        if not candidates:
            return await call_next(request)
        other_models = [view.instance_id for view in self.pipeline.instances.snapshot()
                        if route.model is not None and view.model != route.model]
        placement = await self.sessions.place_or_unpinned(route.session_id, candidates,
                                                          other_models)
        is_hybrid_move = placement.is_moved and self.sessions.config.mode == "hybrid"
        if is_hybrid_move:
            moved = [*request.headers, (SESSION_MOVED_HEADER, "1")]
            request = dataclasses.replace(request, headers=moved)
        response = await call_next(request)
        served_by = response.headers.get(INSTANCE_HEADER)
        response.headers[ROUTING_HEADER] = placement.outcome_served_by(served_by)
        if tracing.is_on():
            tracing.note({"strata.session.routing": response.headers[ROUTING_HEADER]})
        if is_hybrid_move:
            response.headers[SESSION_MOVED_HEADER] = "1"
        return response


class KeyPrefix:
    """Computes the prompt's keys for each candidate once (block hashes with the instance's
    tokenizer, or text keys), so the cache-aware policy scores them and learns where they went;
    a retry reuses them."""

    def __init__(self, prefix: PrefixRouting, pipeline: RoutingPipeline) -> None:
        self.prefix = prefix
        self.pipeline = pipeline

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        if not self.prefix.is_keying():
            return await call_next(request)
        route = request.route
        tenant = ""
        if self.prefix.is_per_tenant:
            tenant = request.tenant
        keys = self.prefix.keys(request.body_json, route.session_id,
                                self.pipeline.candidates(route), tenant)
        if keys is not None:
            request = dataclasses.replace(request, route=dataclasses.replace(route, prefix=keys))
        return await call_next(request)


class HandOff:
    """Prefills a long prompt on a prefill instance when the prefill pool keeps up, then sends
    the request to a decode instance with the handle; otherwise (and whenever the prefill
    instance fails) the decode instance prefills it. The answer is the decode instance's."""

    def __init__(self, pd: PDRouter) -> None:
        self.pd = pd

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        return await self.pd.forward(request, call_next)


__all__ = ["Admit", "CacheAnswers", "ChooseVersion", "HandOff", "Handler", "KeyPrefix",
           "PlaceSession", "Step", "TracedStep", "chain", "path_steps"]
