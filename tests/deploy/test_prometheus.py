"""deploy/prometheus: the scrape configurations and the rule file are well formed.

Every expression is parsed by a real PromQL parser (promql-parser, the Rust parser Prometheus
queries are checked against elsewhere); where Prometheus's own `promtool` is installed
(Debian's `prometheus` package) it checks the files too. Whether the metric names exist is
test_metrics_referenced.py's job.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from deploy_files import (
    DEPLOY,
    RULES,
    load_yaml,
    metric_names,
    recorded_names,
    rule_exprs,
    rule_groups,
)

PROMETHEUS = DEPLOY / "prometheus"
DURATION = re.compile(r"^\d+[smhd]$")
JOBS = {"strata-gateway", "strata-instances"}


def test_every_rule_expression_parses() -> None:
    exprs = rule_exprs()
    assert len(exprs) >= 20
    for where, expr in exprs.items():
        assert metric_names(expr), f"{where}: selects no metric"


def test_the_parser_refuses_what_prometheus_would() -> None:
    for broken in ("sum(rate(strata:x[5m])", "histogram_quantil(0.9, x)", "rate(x)"):
        with pytest.raises(ValueError):
            metric_names(broken)


def test_recording_rules_are_named_level_metric_operation_and_unique() -> None:
    names = [rule["record"] for group in rule_groups() for rule in group["rules"]
             if "record" in rule]
    assert len(names) == len(set(names))
    for name in names:
        assert re.fullmatch(r"strata:[a-z0-9_]+:[a-z0-9_]+", name), name


def test_latency_percentiles_are_recorded_for_ttft_itl_and_e2e() -> None:
    recorded = recorded_names()
    for latency in ("ttft", "itl", "e2e"):
        for p in ("p50", "p90", "p99"):
            assert f"strata:{latency}_seconds:{p}" in recorded
    expr = rule_exprs()["rules.yml: strata:itl_seconds:p90"]
    assert expr.startswith("histogram_quantile(0.90,")
    assert metric_names(expr) == {"strata:time_per_output_token_seconds_bucket"}


def test_alerts_have_a_severity_a_summary_and_a_duration() -> None:
    alerts = {rule["alert"]: rule for group in rule_groups() for rule in group["rules"]
              if "alert" in rule}
    assert {"StrataNoRoutableInstance", "StrataGatewayErrorRate",
            "StrataTTFTP99OverSLO"} <= set(alerts)
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert alert["annotations"]["summary"], name
        assert DURATION.match(alert["for"]), name
    assert metric_names(alerts["StrataTTFTP99OverSLO"]["expr"]) == {"strata:ttft_seconds:p99"}
    assert metric_names(alerts["StrataNoRoutableInstance"]["expr"]) == {
        "strata:gateway_instances_routable"}


def test_alerts_on_up_name_a_job_that_is_scraped() -> None:
    for where, expr in rule_exprs().items():
        for job in re.findall(r'job="([^"]+)"', expr):
            assert job in JOBS, f"{where}: no scrape job {job}"


@pytest.mark.parametrize("name", ["prometheus.yml", "prometheus-kubernetes.yml"])
def test_scrape_configs_scrape_the_gateway_and_the_instances(name: str) -> None:
    config = load_yaml(PROMETHEUS / name)
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == JOBS
    for job in jobs.values():
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert job.get("honor_labels", False) is False  # the gateway's `instance` label
        # becomes exported_instance instead of overwriting the target's


def test_kubernetes_discovery_keeps_the_labels_the_rules_group_by() -> None:
    config = load_yaml(PROMETHEUS / "prometheus-kubernetes.yml")
    instances = next(j for j in config["scrape_configs"] if j["job_name"] == "strata-instances")
    assert instances["kubernetes_sd_configs"] == [{"role": "pod"}]
    targets = {r.get("target_label") for r in instances["relabel_configs"]}
    assert {"model_version", "role", "pool", "namespace", "__address__"} <= targets
    static = load_yaml(PROMETHEUS / "prometheus.yml")
    labels = next(j for j in static["scrape_configs"]
                  if j["job_name"] == "strata-instances")["static_configs"][0]["labels"]
    assert {"model_version", "role", "pool"} <= set(labels)


@pytest.mark.needs("promtool")
def test_promtool_accepts_the_rules_and_the_static_config(tmp_path: Path) -> None:
    done = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    # The config names the rule file where compose mounts it; check it next to a copy.
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    config = (PROMETHEUS / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(
        config.replace("/etc/prometheus/rules.yml", str(tmp_path / "rules.yml")))
    done = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.needs("promtool")
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    """Synthetic series through the real rule engine: p99 from buckets, the error ratio, and
    the alerts firing (and not firing) when they should."""
    done = subprocess.run(["promtool", "test", "rules", "promtool_rules_test.yml"],
                          cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
