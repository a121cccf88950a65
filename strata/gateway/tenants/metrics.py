"""This gateway's usage by tenant and model on /metrics, with a bounded number of series.

    strata:gateway_tenant_requests_total{tenant, model}            requests (refused ones too)
    strata:gateway_tenant_errors_total{tenant, model}              answers that were errors
    strata:gateway_tenant_rate_limited_total{tenant, model}        refused by the key's budget
    strata:gateway_tenant_tokens_total{tenant, model, kind}        kind: prompt, cached, completion

At each scrape the `top_tenants` tenants with the most tokens (then requests) keep their label
and the rest are summed under tenant="other"; models likewise (`top_models`). A tenant is the
sha256 prefix its key names (strata/protocol/keys.py), never the key. These are this gateway's
counts since it started (Prometheus sums the gateways); when the ranking changes a tenant's
series moves between its label and "other", so sum over `tenant` for a fleet total. The counts
every gateway shares are on GET /admin/usage.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from strata.state.usage import Counts, UsageKey

OTHER = "other"


class TenantMetrics(Collector):
    """Counts per (tenant, model) kept in this process; exported top-N at each scrape."""

    def __init__(self, registry: CollectorRegistry, *, top_tenants: int = 10,
                 top_models: int = 20) -> None:
        self.top_tenants = top_tenants
        self.top_models = top_models
        self.counts: dict[UsageKey, Counts] = {}
        registry.register(self)

    def add(self, tenant: str, model: str, counts: Counts) -> None:
        key = (tenant, model)
        self.counts[key] = self.counts.get(key, Counts()) + counts

    def bounded(self) -> dict[UsageKey, Counts]:
        """The counts with every tenant and model past the top N folded into "other"."""
        tenants = _top(self.counts, 0, self.top_tenants)
        models = _top(self.counts, 1, self.top_models)
        out: dict[UsageKey, Counts] = {}
        for (tenant, model), counts in self.counts.items():
            key = (tenant if tenant in tenants else OTHER, model if model in models else OTHER)
            out[key] = out.get(key, Counts()) + counts
        return out

    def collect(self) -> Iterator[CounterMetricFamily]:
        rows = sorted(self.bounded().items())
        labels = ["tenant", "model"]
        for name, what in (("requests", "Requests per tenant and model (refused ones too)."),
                           ("errors", "Answers that were errors, per tenant and model."),
                           ("rate_limited", "Requests refused by the key's budget.")):
            family = CounterMetricFamily(f"strata:gateway_tenant_{name}", what, labels=labels)
            for key, counts in rows:
                family.add_metric(list(key), getattr(counts, name))
            yield family
        tokens = CounterMetricFamily("strata:gateway_tenant_tokens",
                                     "Tokens per tenant and model, as the answers' usage said "
                                     "(kind: prompt, cached, completion).",
                                     labels=[*labels, "kind"])
        for key, counts in rows:
            for kind in ("prompt", "cached", "completion"):
                tokens.add_metric([*key, kind], getattr(counts, f"{kind}_tokens"))
        yield tokens

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())


def _top(counts: dict[UsageKey, Counts], part: int, n: int) -> set[str]:
    sums: dict[str, tuple[int, int]] = {}
    for key, c in counts.items():
        tokens, requests = sums.get(key[part], (0, 0))
        sums[key[part]] = (tokens + c.total_tokens, requests + c.requests)
    return set(sorted(sums, key=lambda name: (-sums[name][0], -sums[name][1], name))[:n])


__all__ = ["OTHER", "TenantMetrics"]
