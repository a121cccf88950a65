"""Prefill/decode hand-off ("P/D") on the gateway: decide per request, ask a prefill instance for a
handle, send the request on to a decode instance with it (the exchange: strata/protocol/pd.py).

    Decider     remote or local (`HandOffAsk` -> `Decision`), from the uncached prompt tokens
                and the prefill pool's backlog. Uncached is what the best decode candidate would
                compute: the prompt's tokens less the leading blocks the gateway's prefix index
                says it holds (the index of `--policy cache_aware`, or one fed by the instances'
                KV events for this step alone), else prompt bytes / 4 when the gateway has no
                keys for the prompt. The capacity planner asks this same decider
                (strata/plan/routing.py)
    PDRouter    the `HandOff` step's work (strata/gateway/path/forward.py)

The handle the decode instance gets names P by instance id and URL, sealed with the fleet's
internal key over every field (strata/protocol/seal.py): D follows no other (pd/trust.py).

Failures never reach the client as errors: a prefill instance that fails (connect error, error
answer, timeout) means the decode instance prefills locally; a decode instance that fails before
the first byte is retried by the proxy on another one with the same handle, which pulls the
blocks again while P's lease lives and otherwise recomputes them, P's first token in hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter
from starlette.responses import Response

from strata import tracing
from strata.clock import Clock
from strata.gateway.config import PDRoutingConfig
from strata.gateway.metrics import CountByLabel
from strata.gateway.path.deadline import deadline_response, with_remaining
from strata.gateway.routing.health import OutlierDetector
from strata.gateway.routing.instances import InstanceView
from strata.gateway.routing.pipeline import RoutingPipeline
from strata.gateway.routing.policies.base import RouteRequest
from strata.gateway.routing.prefix.index import PrefixIndex
from strata.gateway.routing.prefix.prompt import uncached_tokens
from strata.gateway.stats import GatewayStats
from strata.gateway.upstream.pools import UpstreamPools, close_quietly, forwarded_headers
from strata.gateway.upstream.proxy import ProxyRequest
from strata.protocol.pd import (
    DECODE_PREFIX,
    GENERATION_PATHS,
    HANDOFF_HEADER,
    KV_PATH,
    PREFILL_PREFIX,
)
from strata.protocol.seal import seal

log = logging.getLogger("strata.gateway.pd")
BYTES_PER_TOKEN = 4
Handler = Callable[[ProxyRequest], Awaitable[Response]]


class UncachedEstimate(Protocol):
    """How many prompt tokens the decode side would have to compute for `body`."""

    def __call__(self, body: dict[str, Any], decode_candidates: Sequence[InstanceView]) -> int: ...


def prompt_bytes_estimate(body: dict[str, Any], decode_candidates: Sequence[InstanceView]
                          ) -> int:
    """Prompt bytes / 4 (a prompt of token ids: their number); every token counts as
    uncached."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list):
        size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    elif isinstance(prompt, list):
        return len(prompt)
    else:
        size = len(str(prompt or ""))
    return size // BYTES_PER_TOKEN


@dataclass(frozen=True, slots=True)
class HandOffAsk:
    """What the decider reads of a request: its route, whether it is one prompt and one choice
    on a generation path (one handle can serve it), and its uncached prompt tokens on a set of
    decode candidates (asked only when the rules before it pass)."""

    route: RouteRequest
    is_generation: bool
    is_one_choice: bool
    uncached_tokens: Callable[[Sequence[InstanceView]], int]

    @classmethod
    def of(cls, request: ProxyRequest, estimate: UncachedEstimate,
           index: PrefixIndex | None = None) -> HandOffAsk:
        """The gateway's ask for a proxied request (its body parsed once, on the request; its
        prefix keys, when the KeyPrefix step computed them, against `index`)."""
        body, route = request.body_json, request.route
        is_one = body is not None and body.get("n", 1) == 1 and not _is_batch(body.get("prompt"))

        def uncached(decodes: Sequence[InstanceView]) -> int:
            known = [n for v in decodes if index is not None
                     and (n := uncached_tokens(index, route.prefix, v.instance_id)) is not None]
            return min(known) if known else estimate(body or {}, decodes)

        return cls(route, request.path in GENERATION_PATHS, is_one, uncached)


@dataclass(frozen=True, slots=True)
class Decision:
    prefill: InstanceView | None  # None: the decode instance prefills locally
    reason: str  # remote, short, backlog, no_prefill, session, shape


class Decider:
    """Remote prefill when the uncached prompt is long enough and the prefill pool keeps up."""

    def __init__(self, config: PDRoutingConfig, pipeline: RoutingPipeline,
                 estimate: UncachedEstimate = prompt_bytes_estimate) -> None:
        self.config = config
        self.pipeline = pipeline
        self.estimate = estimate

    def decide(self, ask: HandOffAsk) -> Decision:
        route = ask.route
        if route.session_id is not None:
            return Decision(None, "session")  # a session's turn is stored by one instance
        prefill_route = dataclasses.replace(route, role="prefill")
        prefills = self.pipeline.candidates(prefill_route)
        if not prefills or not ask.is_generation:
            return Decision(None, "no_prefill")
        if not ask.is_one_choice:
            return Decision(None, "shape")  # one prompt, one choice: one handle
        if ask.uncached_tokens(self.pipeline.candidates(route)) < self.config.min_uncached_tokens:
            return Decision(None, "short")
        chosen = self.pipeline.policy.choose(prefill_route, prefills)
        if chosen.request_load >= self.config.max_prefill_queue:
            chosen = min(prefills, key=lambda v: v.load_key)
        if chosen.request_load >= self.config.max_prefill_queue:
            return Decision(None, "backlog")  # waiting there would cost more than prefilling
        return Decision(chosen, "remote")


def _is_batch(prompt: object) -> bool:
    """Several prompts (strings or token lists), not one prompt of token ids."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


class PDMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.decisions = Counter("strata:gateway_pd_decisions_total",
                                 "Prefill/decode hand-off decisions, by reason.", ["reason"],
                                 registry=reg)
        self.prefills = Counter("strata:gateway_pd_prefills_total",
                                "Remote prefills, by outcome (ok, failed).", ["outcome"],
                                registry=reg)
        for outcome in ("ok", "failed"):
            self.prefills.labels(outcome)
        self.decided = CountByLabel(self.decisions)  # one per request: children looked up once


class PDRouter:
    """Remote prefill, then the decode instance with the handle (module docstring)."""

    def __init__(self, config: PDRoutingConfig, pipeline: RoutingPipeline,
                 upstreams: UpstreamPools, detector: OutlierDetector, reg: CollectorRegistry,
                 estimate: UncachedEstimate = prompt_bytes_estimate,
                 stats: GatewayStats | None = None, index: PrefixIndex | None = None,
                 seal_key: str | None = None, clock: Clock = time.perf_counter) -> None:
        self.config = config
        self.index = index  # the prefix index the decision reads (None: bytes / 4 only)
        self.seal_key = seal_key  # the fleet's internal key: D follows only sealed handles
        self.stats = stats if stats is not None else GatewayStats()
        self.decider = Decider(config, pipeline, estimate)
        self.pipeline = pipeline
        self.upstreams = upstreams
        self.detector = detector
        self.metrics = PDMetrics(reg)
        self.clock = clock  # the proxy's: a request's deadline is on it
        self._releases: set[asyncio.Task[None]] = set()

    async def forward(self, request: ProxyRequest, call_next: Handler) -> Response:
        request = _without_handle(request)  # only this gateway gives one
        if not self.pipeline.instances.has_role("prefill"):  # the common fleet: no ask built
            self.metrics.decided.inc("no_prefill")
            return await call_next(request)
        decision = self.decider.decide(HandOffAsk.of(request, self.decider.estimate, self.index))
        self.metrics.decided.inc(decision.reason)
        if tracing.is_on():
            tracing.note({"strata.pd.decision": decision.reason, "strata.pd.prefill_instance":
                          decision.prefill.instance_id if decision.prefill else None})
        if decision.prefill is None:
            return await call_next(request)
        self.stats.remote_prefill()
        handle = await self._prefill(decision.prefill, request)
        if handle is None and request.deadline_s is not None \
                and self.clock() >= request.deadline_s:
            return deadline_response()  # P's own deadline answered first: nothing to decode
        if handle is None:
            return await call_next(request)  # the decode instance prefills locally
        headers = [*request.headers, (HANDOFF_HEADER, handle)]
        try:
            return await call_next(dataclasses.replace(
                request, path=DECODE_PREFIX + request.path, headers=headers))
        except asyncio.CancelledError:  # the client left or the deadline passed
            self._release(decision.prefill, handle, request)
            raise

    def _release(self, view: InstanceView, handle: str, request: ProxyRequest) -> None:
        """Ask P to free a handle's blocks now, whether or not a decode instance got it (one
        that did acknowledges it too; the second DELETE is a 404)."""
        path = f"{KV_PATH}/{json.loads(handle)['handle']}"

        async def delete() -> None:
            try:
                await close_quietly(await self.upstreams.send(
                    view, "DELETE", path, b"", forwarded_headers(request.headers)))
            except httpx.HTTPError as exc:
                log.info("releasing a cancelled handle on %s failed (its lease will end): %s",
                         view.instance_id, exc)

        task = asyncio.get_running_loop().create_task(delete())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _prefill(self, view: InstanceView, request: ProxyRequest) -> str | None:
        """P's handle with P's URL, or None when P failed (counted toward its ejection)."""
        # The policy's hooks are left to the decode pick: a round robin that counted both
        # picks of each request would send every request to the same decode instance.
        in_flight = self.pipeline.instances.begin(view, request.route.num_tokens)
        with tracing.span("strata.gateway.pd.prefill",
                          {"strata.instance.id": view.instance_id}) as opened:
            try:  # a deadline that ends first is until_cancelled's to answer (path/deadline.py)
                handle = await asyncio.wait_for(self._ask(view, request),
                                                self.config.prefill_timeout_s)
            except (httpx.HTTPError, TimeoutError, ValueError, KeyError) as exc:
                log.warning("prefill on %s failed (decoding locally): %s", view.instance_id, exc)
                self.detector.record_failure(view)
                handle = None
            finally:
                self.pipeline.instances.end(in_flight)
            tracing.annotate(opened, **{"strata.pd.has_handle": handle is not None})
        self.metrics.prefills.labels("ok" if handle is not None else "failed").inc()
        return handle

    async def _ask(self, view: InstanceView, request: ProxyRequest) -> str | None:
        headers = with_remaining(forwarded_headers(request.headers), request.deadline_s,
                                 self.clock())
        headers = tracing.inject(headers)  # P's span: a child of the prefill call's
        response = await self.upstreams.send(view, "POST", PREFILL_PREFIX + request.path,
                                             request.body, headers)
        try:
            body = await response.aread()
        finally:
            await close_quietly(response)
        if response.status_code != 200:
            if response.status_code >= 500:
                self.detector.record_failure(view)
            log.info("prefill on %s answered %d (decoding locally)", view.instance_id,
                     response.status_code)
            return None
        self.detector.record_success(view)
        data = json.loads(body) | {"url": view.url, "instance_id": view.instance_id}
        if self.seal_key is not None:
            data = seal(data, self.seal_key)
        return json.dumps(data, separators=(",", ":"))


def _without_handle(request: ProxyRequest) -> ProxyRequest:
    headers = [(k, v) for k, v in request.headers if k.lower() != HANDOFF_HEADER]
    if len(headers) == len(request.headers):
        return request
    return dataclasses.replace(request, headers=headers)


__all__ = ["Decider", "Decision", "HandOffAsk", "PDRouter", "UncachedEstimate",
           "prompt_bytes_estimate"]
