"""deploy/grafana: the dashboard is what its generator writes, lays out cleanly, parses, and is
provisioned where compose mounts it."""

from __future__ import annotations

import re
import subprocess
import sys

from deploy_files import (
    DASHBOARD,
    DEPLOY,
    dashboard,
    dashboard_exprs,
    dashboard_panels,
    load_yaml,
    metric_names,
)

GRAFANA = DEPLOY / "grafana"
VARIABLE = re.compile(r"\$\{?(\w+)\}?")


def test_strata_json_is_what_make_dashboard_writes() -> None:
    done = subprocess.run([sys.executable, str(GRAFANA / "make_dashboard.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_the_dashboard_covers_fleet_latency_cache_sessions_and_releases() -> None:
    rows = [p["title"] for p in dashboard()["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Latency", "Cache", "Sessions and KV offload",
                    "Releases and versions"]
    titles = {p["title"] for p in dashboard_panels()}
    assert {"Instances up", "Routable instances", "Requests/s", "Time to first token",
            "Inter-token latency (time per output token)", "End-to-end request latency",
            "Prefix cache hit rate per instance", "Response cache hit ratio",
            "KV blocks fetched and published /s", "Instances up per version"} <= titles


def test_every_query_parses_and_selects_a_metric() -> None:
    exprs = dashboard_exprs()
    assert len(exprs) > 40
    for where, expr in exprs.items():
        assert metric_names(expr), f"{where}: selects no metric"


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"])
                 for dy in range(pos["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_queries_use_only_defined_variables_and_the_datasource_variable() -> None:
    defined = {v["name"] for v in dashboard()["templating"]["list"]}
    assert defined == {"datasource", "model", "version"}
    for panel in dashboard_panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            for name in VARIABLE.findall(target["expr"]):
                assert name.startswith("__") or name in defined, f"{panel['title']}: ${name}"


def test_provisioning_points_at_prometheus_and_at_the_mounted_dashboard() -> None:
    sources = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    [source] = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "strata.yml")
    [provider] = providers["providers"]
    compose = load_yaml(DEPLOY / "compose.yaml")
    mounts = compose["services"]["grafana"]["volumes"]
    mounted = f"./grafana/strata.json:{provider['options']['path']}/{DASHBOARD.name}:ro"
    assert mounted in mounts
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
