"""The tracing flags of `strata gateway` and `strata serve` (strata/tracing/): off unless
`--otlp-endpoint` names a collector."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from strata import tracing
from strata.commands.argtypes import ratio
from strata.errors import ConfigError


def add_tracing_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="trace every request with OpenTelemetry, exporting spans over OTLP/HTTP "
                        "to this collector (e.g. http://127.0.0.1:4318; /v1/traces is added "
                        "when the URL has no path). Off by default")
    p.add_argument("--trace-sample-ratio", type=ratio, default=None, metavar="RATIO",
                   help="the share of requests traced, in [0, 1] (default 1.0 with "
                        "--otlp-endpoint); a request that arrives with a sampled traceparent "
                        "is traced whatever the ratio, so the gateway's choice holds on "
                        "every instance")


# (flag, type): what `strata up` passes through to its gateway and to every instance
TRACING_FLAGS: tuple[tuple[str, Callable[[str], Any]], ...] = (
    ("--otlp-endpoint", str), ("--trace-sample-ratio", ratio))


def tracing_args(args: argparse.Namespace) -> list[str]:
    """The tracing flags given to `strata up`, as arguments of the commands it starts."""
    found: list[str] = []
    for flag, _ in TRACING_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        found += [flag, str(value)] if value is not None else []
    return found


def tracing_config(args: argparse.Namespace, service_name: str) -> tracing.TracingConfig:
    """The flags as a config; a ratio without an endpoint is an error (it would trace nothing)."""
    if args.otlp_endpoint is None and args.trace_sample_ratio is not None:
        raise ConfigError("--trace-sample-ratio needs --otlp-endpoint (tracing is off without "
                          "a collector to send spans to)")
    ratio_given = args.trace_sample_ratio
    return tracing.TracingConfig(args.otlp_endpoint,
                                 1.0 if ratio_given is None else ratio_given, service_name)


def start_tracing(config: tracing.TracingConfig) -> None:
    """Turn tracing on for the apps built after this call (nothing when it is off)."""
    if config.is_on:
        tracing.start(tracing.tracer_provider(config))


__all__ = ["TRACING_FLAGS", "add_tracing_flags", "start_tracing", "tracing_args",
           "tracing_config"]
