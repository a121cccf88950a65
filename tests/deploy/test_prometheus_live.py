"""A real Prometheus scrapes a live simulated instance and gateway with deploy/'s rules loaded,
and answers every query of the dashboard, the rules and the KEDA trigger without an error;
the latency percentiles and rates come back with data.

Runs only where a `prometheus` binary is installed (Debian's `prometheus` package); the checks
that need no Prometheus (names, syntax) run everywhere in test_metrics_referenced.py and
test_prometheus.py.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from deploy_files import (
    ALL_OPTIONS,
    RULES,
    dashboard_exprs,
    keda_queries,
    render_chart,
    rule_exprs,
)
from harness.procs import wait_until
from live_stack import drive_traffic, kill_after, start_gateway
from serve_process import start_serve

from strata.cluster.local import free_port

pytestmark = pytest.mark.needs("prometheus")


def prometheus_config(gateway: str, instance: str, rules: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with the live processes as targets, scraped each second."""
    def target(url: str) -> str:
        return url.removeprefix("http://")

    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": "strata-gateway", "static_configs": [{"targets": [target(gateway)]}]},
                {"job_name": "strata-instances", "static_configs": [
                    {"targets": [target(instance)],
                     "labels": {"model_version": "v1", "role": "mixed", "pool": "default"}}]}]}


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", f"{expr}: {body.get('error')}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("prometheus")
    registry = f"sqlite:///{root / 'registry.db'}"
    instance = start_serve(["--simulate", "smollm2-cpu", "--model-version", "v1",
                            "--registry", registry, "--instance-id", "sim-1",
                            "--log-level", "warning"], cache_dir=root / "cache", timeout_s=120)
    gateway = start_gateway(["--registry", registry, "--response-cache", "memory://",
                             "--health-check-interval-s", "0.2"])
    (root / "prometheus.yml").write_text(yaml.safe_dump(
        prometheus_config(gateway.url, instance.url, RULES)))
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={root / 'prometheus.yml'}",
                             f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    timer = kill_after(proc, 300)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, 30,
                   "the gateway to route")
        wait_until(lambda: _answers(f"{url}/-/ready"), 60, "prometheus to start")
        # two rounds of traffic a few scrapes apart, so that rate() has two points to compare
        drive_traffic(gateway.url, instance.served_name)
        wait_until(lambda: len(query(url, "up == 1")) == 2, 30, "both targets scraped")
        drive_traffic(gateway.url, instance.served_name)
        wait_until(lambda: bool(query(url, "strata:ttft_seconds:p99")), 60,
                   "the TTFT p99 rule to have data")
        yield url
    finally:
        timer.cancel()
        proc.terminate()
        proc.wait(timeout=30)
        gateway.stop()
        instance.stop()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_query_evaluates_without_an_error(prometheus: str) -> None:
    exprs = {**rule_exprs(), **dashboard_exprs(), **keda_queries(render_chart(ALL_OPTIONS))}
    for expr in exprs.values():
        query(prometheus, expr)


def test_rules_load_and_evaluate_healthily(prometheus: str) -> None:
    body = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()
    rules = [r for g in body["data"]["groups"] for r in g["rules"]]
    assert len(rules) == len(rule_exprs())
    assert [r["name"] for r in rules if r["health"] != "ok"] == []


@pytest.mark.parametrize("expr", [
    'strata:ttft_seconds:p50{model_name="SmolLM2-135M-Instruct", model_version="v1"}',
    "strata:itl_seconds:p99", "strata:e2e_seconds:p90",
    "strata:gateway_requests:rate5m", "strata:requests_finished:rate5m",
    "strata:generation_tokens:rate5m", "strata:gateway_added_latency_seconds:p99",
    "strata:gateway_response_cache_hit_ratio:rate5m",
    'count by (model_version) (up{job="strata-instances"} == 1)',
])
def test_recorded_and_dashboard_series_have_data(prometheus: str, expr: str) -> None:
    wait_until(lambda: bool(query(prometheus, expr)), 30, f"{expr} to have data")
    [sample, *_] = query(prometheus, expr)
    assert float(sample["value"][1]) >= 0

