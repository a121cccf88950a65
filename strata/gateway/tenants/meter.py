"""`MeterTenants`: the first step of the gateway's path (strata/gateway/path/forward.py).

A request whose key has a budget takes one request from its tenant's window; over the budget it
is answered 429 at once (Retry-After, the `x-ratelimit-*` headers, an OpenAI error body), before
any queue or instance. Then the answer is counted once it is whole (a stream at its end, however
it ends): its tenant's usage per model in the shared store and on this gateway's /metrics, and
its tokens charged to the tenant's window. A stream without a usage chunk (the request did not
set `stream_options.include_usage`) counts its request and no tokens; a budgeted key is then
charged the gateway's estimate (prompt bytes / 4 + max_tokens) so that it cannot stream around
its budget.

The store failing does not fail the request: the request is admitted unmetered, the failure
counted on `strata:gateway_errors_total{reason="usage_store"}` and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.responses import Response

from strata.errors import UsageStoreError
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.tenants.budgets import Budgets, over_budget, rate_limit_headers
from strata.gateway.tenants.metrics import TenantMetrics
from strata.gateway.tenants.usage import StreamTap, counts_of_body
from strata.gateway.upstream.pools import RelayResponse
from strata.gateway.upstream.proxy import ProxyRequest
from strata.protocol.budgets import KeyLimits
from strata.state.usage import Counts, UsageStore, Window

logger = logging.getLogger("strata.gateway.tenants")
PUBLIC = "public"  # the tenant of requests without a client key (a gateway without keys)
Handler = Callable[[ProxyRequest], Awaitable[Response]]


def tenant_of(request: ProxyRequest) -> str:
    """The tenant the gateway forwards for this request (set from the caller's key only)."""
    return request.tenant or PUBLIC


class MeterTenants:
    """Holds budgets and counts usage (see the module docstring)."""

    def __init__(self, store: UsageStore, budgets: Budgets, tenants: TenantMetrics,
                 metrics: GatewayMetrics) -> None:
        self.store = store
        self.budgets = budgets
        self.tenants = tenants
        self.metrics = metrics

    async def __call__(self, request: ProxyRequest, call_next: Handler) -> Response:
        tenant, model = tenant_of(request), request.route.model or ""
        limits = self.budgets.limits.get(tenant)
        window = await self._take(tenant, limits) if limits is not None else None
        if limits is not None and window is not None:
            if not window.is_admitted:
                self.metrics.errors.labels("over_budget").inc()
                await self._count(tenant, model, Counts(requests=1, errors=1, rate_limited=1))
                return over_budget(limits, window)
        response = await call_next(request)
        if limits is not None and window is not None:
            response.headers.update(rate_limit_headers(limits, window))
        estimate = request.route.num_tokens
        if isinstance(response, RelayResponse):
            async def done(tap: StreamTap) -> None:
                await self._answered(tenant, model, tap.counts, tap.usage is not None, limits,
                                     estimate)

            response.relay_through(lambda frames: StreamTap().relay(frames, done))
            return response
        body = getattr(response, "body", b"")
        counts, is_known = counts_of_body(response.status_code, bytes(body))
        await self._answered(tenant, model, counts, is_known, limits, estimate)
        return response

    async def _take(self, tenant: str, limits: KeyLimits) -> Window | None:
        try:
            return await self.budgets.take(tenant, limits)
        except UsageStoreError as exc:
            self._store_failed(exc)
            return None

    async def _answered(self, tenant: str, model: str, counts: Counts, is_known: bool,
                        limits: KeyLimits | None, estimate: int) -> None:
        if limits is not None and limits.tokens_per_min is not None:
            tokens = counts.total_tokens if is_known or counts.errors else estimate
            try:
                await self.budgets.charge(tenant, tokens)
            except UsageStoreError as exc:
                self._store_failed(exc)
        await self._count(tenant, model, counts)

    async def _count(self, tenant: str, model: str, counts: Counts) -> None:
        self.tenants.add(tenant, model, counts)
        try:
            await self.store.add(tenant, model, counts)
        except UsageStoreError as exc:
            self._store_failed(exc)

    def _store_failed(self, exc: UsageStoreError) -> None:
        self.metrics.errors.labels("usage_store").inc()
        logger.warning("usage store failed; the request goes on unmetered: %s", exc)


__all__ = ["PUBLIC", "MeterTenants", "tenant_of"]
