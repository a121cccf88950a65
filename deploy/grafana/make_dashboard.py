"""Writes deploy/grafana/strata.json, the Grafana dashboard of a Strata fleet.

    python deploy/grafana/make_dashboard.py          # rewrite strata.json
    python deploy/grafana/make_dashboard.py --check  # exit 1 if strata.json is out of date

The dashboard is generated so that its layout stays regular (one row of panels after another)
and its queries stay in one readable place; tests/deploy checks that strata.json is what this
script writes and that every metric it names exists on a live /metrics. The recorded series
(`strata:ttft_seconds:p99`, ...) come from deploy/prometheus/rules.yml.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("strata.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
MODEL = 'model_name=~"$model"'
SEL = 'model_name=~"$model", model_version=~"$version"'


@dataclass
class Panel:
    title: str
    queries: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    description: str = ""
    options: dict[str, Any] = field(default_factory=dict)


def stat(title: str, expr: str, unit: str = "short", description: str = "") -> Panel:
    return Panel(title, [(expr, "")], unit, "stat", width=4, height=4, description=description,
                 options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value",
                          "graphMode": "area"})


def percentiles(title: str, recorded: str) -> Panel:
    """p50/p90/p99 of a latency, from the series recorded by rules.yml."""
    return Panel(title, [(f"strata:{recorded}:{p}{{{SEL}}}", f"{p} {{{{model_name}}}}@"
                          f"{{{{model_version}}}}") for p in ("p50", "p90", "p99")], "s")


FLEET = [
    stat("Gateways up", 'sum(up{job="strata-gateway"})'),
    stat("Instances up", 'sum(up{job="strata-instances"})'),
    stat("Routable instances", "min(strata:gateway_instances_routable)",
         description="Instances the gateway can route to (ready, healthy, not ejected or "
                     "draining); the lowest over all gateways."),
    stat("Requests/s", f"sum(rate(strata:gateway_requests_total[{RATE}]))", "reqps"),
    stat("Gateway error ratio", "sum(strata:gateway_error_ratio:rate5m)", "percentunit"),
    stat("Simulated instances", "sum(strata:simulated)",
         description="Instances started with --simulate (a latency model, not the model)."),
    Panel("Requests/s by endpoint",
          [(f"sum by (endpoint) (rate(strata:gateway_requests_total[{RATE}]))", "{{endpoint}}")],
          "reqps"),
    Panel("Gateway errors/s by reason",
          [(f"sum by (reason) (rate(strata:gateway_errors_total[{RATE}]))", "{{reason}}")],
          "reqps"),
    Panel("Admission: in flight and queued",
          [("sum(strata:gateway_requests_in_flight)", "in flight"),
           ("sum(strata:gateway_requests_queued)", "queued")]),
    Panel("Requests routed per instance",
          [(f"sum by (exported_instance) (rate(strata:gateway_routing_decisions_total[{RATE}]))",
            "{{exported_instance}}")], "reqps",
          description="The gateway's own instance label is kept as exported_instance."),
    Panel("Retries, ejections, broken streams, upstream failures /s",
          [(f"sum(rate(strata:gateway_retries_total[{RATE}]))", "retries"),
           (f"sum(rate(strata:gateway_ejections_total[{RATE}]))", "ejections"),
           (f"sum(rate(strata:gateway_broken_streams_total[{RATE}]))", "broken streams"),
           (f"sum by (exported_instance) "
            f"(rate(strata:gateway_upstream_failures_total[{RATE}]))",
            "failures {{exported_instance}}")], "ops"),
    Panel("Instance load: running and waiting",
          [(f"sum by (instance) (strata:num_requests_running{{{MODEL}}})", "running {{instance}}"),
           (f"sum by (instance) (strata:num_requests_waiting{{{MODEL}}})",
            "waiting {{instance}}")]),
    Panel("Instances", [('up{job="strata-instances"}', "")], kind="table", width=24, height=6,
          description="Every scraped instance with its version, role and pool (1 = up).",
          options={"showHeader": True}),
]

LATENCY = [
    percentiles("Time to first token", "ttft_seconds"),
    percentiles("Inter-token latency (time per output token)", "itl_seconds"),
    percentiles("End-to-end request latency", "e2e_seconds"),
    Panel("Output tokens/s",
          [(f"sum by (model_name, model_version) "
            f"(rate(strata:generation_tokens_total{{{SEL}}}[{RATE}]))",
            "{{model_name}}@{{model_version}}")]),
    Panel("Prompt tokens/s",
          [(f"sum by (model_name, model_version) "
            f"(rate(strata:prompt_tokens_total{{{SEL}}}[{RATE}]))",
            "{{model_name}}@{{model_version}}")]),
    Panel("Gateway added latency",
          [("strata:gateway_added_latency_seconds:p50", "p50"),
           ("strata:gateway_added_latency_seconds:p99", "p99")], "s"),
]

CACHE = [
    Panel("Prefix cache hit rate per instance",
          [(f"strata:prefix_cache_hit_rate{{{SEL}}}", "{{instance}}")], "percentunit"),
    Panel("KV cache usage per instance",
          [(f"strata:kv_cache_usage_ratio{{{SEL}}}", "{{instance}}")], "percentunit"),
    Panel("Preemptions/s",
          [(f"sum by (instance) (rate(strata:num_preemptions_total{{{SEL}}}[{RATE}]))",
            "{{instance}}")], "ops"),
    Panel("Response cache hit ratio",
          [("strata:gateway_response_cache_hit_ratio:rate5m", "hit ratio")], "percentunit"),
    Panel("Response cache events/s",
          [(f"sum by (event) (rate(strata:gateway_response_cache[{RATE}]))", "{{event}}")], "ops",
          description="Only gateways started with --response-cache export these."),
]

SESSIONS = [
    Panel("Session history served from offloaded KV (tokens/s)",
          [(f"sum by (model_name, model_version) "
            f"(rate(strata:kv_external_hit_tokens_total{{{SEL}}}[{RATE}]))",
            "{{model_name}}@{{model_version}}")],
          description="Prompt tokens (a session's history, mostly) fetched from the KV store "
                      "instead of recomputed: instances started with --kv-offload."),
    Panel("KV blocks fetched and published /s",
          [(f"sum(rate(strata:kv_fetched_blocks_total{{{SEL}}}[{RATE}]))", "fetched"),
           (f"sum(rate(strata:kv_published_blocks_total{{{SEL}}}[{RATE}]))", "published")],
          "ops"),
    Panel("KV bytes fetched and published /s",
          [(f"sum(rate(strata:kv_fetched_bytes_total{{{SEL}}}[{RATE}]))", "fetched"),
           (f"sum(rate(strata:kv_published_bytes_total{{{SEL}}}[{RATE}]))", "published")],
          "Bps"),
    Panel("KV fetch latency",
          [(f"histogram_quantile(0.50, sum by (le) "
            f"(rate(strata:kv_fetch_seconds_bucket{{{SEL}}}[{RATE}])))", "p50"),
           (f"histogram_quantile(0.99, sum by (le) "
            f"(rate(strata:kv_fetch_seconds_bucket{{{SEL}}}[{RATE}])))", "p99")], "s"),
    Panel("KV offload failures /s",
          [(f"sum(rate(strata:kv_fetch_errors_total{{{SEL}}}[{RATE}]))", "fetch errors"),
           (f"sum(rate(strata:kv_publish_errors_total{{{SEL}}}[{RATE}]))", "publish errors"),
           (f"sum(rate(strata:kv_decode_failures_total{{{SEL}}}[{RATE}]))", "refused blocks")],
          "ops"),
]

RELEASES = [
    Panel("Instances up per version",
          [('count by (model_version) (up{job="strata-instances"} == 1)',
            "{{model_version}}")]),
    Panel("Finished requests/s per version",
          [(f"sum by (model_name, model_version) "
            f"(rate(strata:request_success_total{{{SEL}}}[{RATE}]))",
            "{{model_name}}@{{model_version}}")], "reqps"),
    Panel("Finish reasons/s",
          [(f"sum by (finish_reason) (rate(strata:request_success_total{{{SEL}}}[{RATE}]))",
            "{{finish_reason}}")], "reqps"),
    Panel("TTFT p99 per version (canary vs live)",
          [(f"strata:ttft_seconds:p99{{{SEL}}}", "{{model_name}}@{{model_version}}")], "s"),
    Panel("Error ratio per version",
          [(f"strata:instance_error_ratio:rate5m{{{SEL}}}",
            "{{model_name}}@{{model_version}}")], "percentunit",
          description="Requests an instance ended with finish_reason error or abort."),
]

ROWS = [("Fleet", FLEET), ("Latency", LATENCY), ("Cache", CACHE),
        ("Sessions and KV offload", SESSIONS), ("Releases and versions", RELEASES)]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    targets = [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr,
                "legendFormat": legend or "__auto", "range": panel.kind != "table",
                "instant": panel.kind == "table",
                **({"format": "table"} if panel.kind == "table" else {})}
               for i, (expr, legend) in enumerate(panel.queries)]
    return {"id": panel_id, "type": panel.kind, "title": panel.title,
            "description": panel.description, "datasource": DS,
            "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": panel.options, "targets": targets}


def layout() -> list[dict[str, Any]]:
    """Rows one after another; panels left to right, wrapping at Grafana's 24 columns."""
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for title, row in ROWS:
        panels.append({"id": next_id, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y = next_id + 1, y + 1
        x, line_height = 0, 0
        for panel in row:
            if x + panel.width > 24:
                x, y, line_height = 0, y + line_height, 0
            panels.append(panel_json(panel, next_id, x, y))
            next_id += 1
            x, line_height = x + panel.width, max(line_height, panel.height)
        y += line_height
    return panels


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"text": "All", "value": "$__all"}, "sort": 1}


def dashboard() -> dict[str, Any]:
    return {
        "uid": "strata-fleet",
        "title": "Strata",
        "description": "A Strata fleet: gateways, instances, latency, caches, KV offload, "
                       "versions. Generated by deploy/grafana/make_dashboard.py.",
        "tags": ["strata", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0},
            variable("model", "Model", "label_values(strata:request_success_total, model_name)"),
            variable("version", "Version", 'label_values(strata:request_success_total'
                                           '{model_name=~"$model"}, model_version)'),
        ]},
        "annotations": {"list": []},
        "panels": layout(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
