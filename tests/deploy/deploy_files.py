"""What the files under deploy/ say, read the way Prometheus, Grafana and Helm read them.

    rule_exprs(), dashboard_exprs()   every PromQL expression, keyed by where it is
    metric_names(expr)                the metric names an expression selects (a real PromQL parse)
    exported_names(text)              the metric names a /metrics exposition declares
    unknown_names(...)                referenced names that nothing exports or records
    render_chart(values)              `helm template` of deploy/helm/strata, as a list of objects
    parse_strata(argv)                a command line as `strata` itself parses it
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import promql_parser
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "strata.json"
CHART = DEPLOY / "helm" / "strata"
ALL_OPTIONS = CHART / "ci" / "all-options-values.yaml"

# Series Prometheus makes itself for every target: not on any /metrics.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


class UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a mapping with the same key twice (PyYAML keeps the last one
    silently; Kubernetes and Prometheus would see the same, which hides mistakes)."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *anchor` keys may be overridden: that is what merging is for
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(path_or_text: Path | str) -> Any:
    text = path_or_text.read_text() if isinstance(path_or_text, Path) else path_or_text
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def load_all_yaml(text: str) -> list[Any]:
    return [doc for doc in yaml.load_all(text, Loader=UniqueKeyLoader) if doc]  # noqa: S506


# --- PromQL ---------------------------------------------------------------------------------

def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects; raises ValueError when it does not parse."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = load_yaml(RULES)["groups"]
    return groups


def rule_exprs() -> dict[str, str]:
    """{"rules.yml: <record or alert name>": expr}."""
    return {f"rules.yml: {rule.get('record') or rule.get('alert')}": rule["expr"]
            for group in rule_groups() for rule in group["rules"]}


def recorded_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"]
            if "record" in rule}


_GRAFANA_RANGES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.*),\s*\w+\)$")


def grafana_to_promql(expr: str) -> str:
    """Grafana's query text as Prometheus receives it: ranges filled in, `$model` etc. as `.*`
    (they only appear inside label matchers)."""
    for variable, value in _GRAFANA_RANGES.items():
        expr = expr.replace(variable, value)
    return _GRAFANA_VARIABLE.sub(".*", expr)


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> dict[str, str]:
    """{"strata.json: <panel title> [refId]": expr}, template variables' queries included."""
    exprs = {f"strata.json: {panel['title']} [{target['refId']}]":
             grafana_to_promql(target["expr"])
             for panel in dashboard_panels() for target in panel["targets"]}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = _LABEL_VALUES.match(variable["query"]["query"])
        assert match, f"variable {variable['name']}: expected label_values(SELECTOR, LABEL)"
        exprs[f"strata.json: variable {variable['name']}"] = grafana_to_promql(
            match["selector"])
    return exprs


# --- /metrics -------------------------------------------------------------------------------

_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\w+)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})? \S+")


def exported_names(exposition: str) -> dict[str, str]:
    """{name: type} of every family declared (`# TYPE`) in a text exposition, plus each sample's
    own name (histogram series, counters' `_created`) as "sample"."""
    names: dict[str, str] = {}
    for line in exposition.splitlines():
        if m := _TYPE_LINE.match(line):
            names[m[1]] = m[2]
        elif m := _SAMPLE.match(line):
            names.setdefault(m[1], "sample")
    return names


def is_exported(name: str, exported: dict[str, str]) -> bool:
    if name in exported:
        return True
    return any(name.endswith(suffix) and exported.get(name[: -len(suffix)]) == "histogram"
               for suffix in HISTOGRAM_SUFFIXES)


def unknown_names(referenced: dict[str, str], exported: dict[str, str],
                  recorded: Iterable[str]) -> dict[str, list[str]]:
    """{metric name: [where referenced]} for every name in the expressions of `referenced`
    ({where: expr}) that is neither exported, recorded by a rule, nor Prometheus's own."""
    known = set(recorded) | PROMETHEUS_SERIES
    unknown: dict[str, list[str]] = {}
    for where, expr in referenced.items():
        for name in sorted(metric_names(expr)):
            if name not in known and not is_exported(name, exported):
                unknown.setdefault(name, []).append(where)
    return unknown


# --- Helm -----------------------------------------------------------------------------------

def helm() -> str:
    """The helm binary of the `helm-binary` package (next to this Python), else one on PATH."""
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.exists() else shutil.which("helm")
    if found is None:
        raise AssertionError("no helm binary: `make install` installs helm-binary (dev extra)")
    return found


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def render_chart(*values: Path | str, namespace: str = "serving") -> list[dict[str, Any]]:
    """`helm template` with these values files (paths) or inline `--set` strings."""
    flags: list[str] = []
    for value in values:
        flags += ["-f", str(value)] if isinstance(value, Path) else ["--set", value]
    done = run_helm("template", "strata", str(CHART), "--namespace", namespace, *flags)
    if done.returncode != 0:
        raise RenderError(done.stderr)
    return load_all_yaml(done.stdout)


class RenderError(AssertionError):
    """`helm template` refused the values; the message is helm's."""


def keda_queries(manifests: list[dict[str, Any]]) -> dict[str, str]:
    """{"ScaledObject <name>": query} of every Prometheus trigger."""
    return {f"ScaledObject {m['metadata']['name']}": trigger["metadata"]["query"]
            for m in manifests if m["kind"] == "ScaledObject"
            for trigger in m["spec"]["triggers"] if trigger["type"] == "prometheus"}


# --- Strata's own command line ----------------------------------------------------------------

def parse_strata(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by the real `strata` parser; a flag it does not know fails the test, and
    so does an abbreviated one (argparse would take `--advertise-ur` for `--advertise-url`)."""
    from strata.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                subparser.allow_abbrev = False
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"strata refuses {argv}:\n{errors.getvalue()}") from None
