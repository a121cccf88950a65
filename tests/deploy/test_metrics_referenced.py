"""Every metric that deploy/ refers to exists on a live /metrics.

A real `strata serve --simulate` instance and a real `strata gateway` in front of it (sharing an
SQLite registry; the gateway with a response cache) serve a few requests: a plain answer, the
same answer again (a cache hit: the request names its version, which the cache key needs), a
stream and a malformed request. Then both /metrics are scraped, and every metric name in the
recording rules and alerts (deploy/prometheus/rules.yml), the Grafana dashboard
(deploy/grafana/strata.json, its panels and its variables) and the Helm chart's KEDA queries
must be exported by one of them, recorded by a rule, or be Prometheus's own (`up`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from deploy_files import (
    ALL_OPTIONS,
    dashboard_exprs,
    exported_names,
    keda_queries,
    recorded_names,
    render_chart,
    rule_exprs,
    unknown_names,
)
from harness.procs import wait_until
from live_stack import drive_traffic, start_gateway
from serve_process import start_serve


@dataclass(frozen=True)
class Scrapes:
    instance: str
    gateway: str

    @property
    def exported(self) -> dict[str, str]:
        return {**exported_names(self.instance), **exported_names(self.gateway)}


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapes]:
    root: Path = tmp_path_factory.mktemp("stack")
    registry = f"sqlite:///{root / 'registry.db'}"
    instance = start_serve(["--simulate", "smollm2-cpu", "--model-version", "v1",
                            "--registry", registry, "--instance-id", "sim-1",
                            "--log-level", "warning"], cache_dir=root / "cache", timeout_s=120)
    gateway = None
    try:
        gateway = start_gateway(["--registry", registry, "--response-cache", "memory://",
                                 "--health-check-interval-s", "0.2"])
        url = gateway.url
        wait_until(lambda: httpx.get(f"{url}/ready", timeout=5).status_code == 200, 30,
                   "the gateway to route to the instance")
        drive_traffic(gateway.url, instance.served_name)
        yield Scrapes(instance=httpx.get(f"{instance.url}/metrics", timeout=5).text,
                      gateway=httpx.get(f"{gateway.url}/metrics", timeout=5).text)
    finally:
        if gateway is not None:
            gateway.stop()
        instance.stop()


def referenced() -> dict[str, str]:
    """{where: PromQL} of everything deploy/ asks Prometheus for."""
    return {**rule_exprs(), **dashboard_exprs(), **keda_queries(render_chart(ALL_OPTIONS))}


def test_every_metric_deploy_refers_to_is_exported(scrapes: Scrapes) -> None:
    unknown = unknown_names(referenced(), scrapes.exported, recorded_names())
    assert not unknown, "metrics referenced but not exported by a live gateway or instance:\n" + \
        "\n".join(f"  {name}: {', '.join(where)}" for name, where in sorted(unknown.items()))


def test_every_exported_family_the_dashboard_needs_has_samples(scrapes: Scrapes) -> None:
    """The traffic above made the series the latency and cache panels read, so the check
    above is about real series, not only declared families."""
    samples = scrapes.instance + scrapes.gateway
    for series in ("strata:time_to_first_token_seconds_bucket",
                   "strata:time_per_output_token_seconds_bucket",
                   "strata:e2e_request_latency_seconds_bucket",
                   'strata:request_success_total{finish_reason="length"',
                   "strata:gateway_added_latency_seconds_bucket",
                   'strata:gateway_response_cache{event="hits"} 1.0',
                   'strata:gateway_errors_total{reason="bad_request"} 1.0',
                   "strata:simulated 1.0"):
        assert series in samples, f"no {series} after the traffic"


def test_recording_rules_do_not_shadow_exported_metrics(scrapes: Scrapes) -> None:
    assert not recorded_names() & set(scrapes.exported)


def test_a_misspelt_metric_is_reported_with_where_it_is_used(scrapes: Scrapes) -> None:
    """The check above can fail: one wrong letter in a panel's query is named."""
    exprs = {"strata.json: Requests/s": "sum(rate(strata:gateway_request_total[5m]))",
             "strata.json: TTFT": 'strata:time_to_first_token_second_bucket{le="1"}',
             "rules.yml: ok": "sum(rate(strata:time_to_first_token_seconds_bucket[5m]))"}
    assert unknown_names(exprs, scrapes.exported, recorded_names()) == {
        "strata:gateway_request_total": ["strata.json: Requests/s"],
        "strata:time_to_first_token_second_bucket": ["strata.json: TTFT"],
    }
