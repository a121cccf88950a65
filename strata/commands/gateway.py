"""`strata gateway`: the load balancer in front of instances (from a registry or static URLs).

SIGTERM/SIGINT stop accepting connections, let requests in flight finish (streams included, up to
--shutdown-timeout-s) and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import signal
import time
from typing import Any

import httpx

from strata.commands import aio
from strata.commands.argtypes import (
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from strata.commands.autoscale_flags import add_autoscale_flags, build_autoscaler
from strata.commands.class_flags import add_class_flags, class_config
from strata.commands.env import (
    CliEnv,
    add_auth_flags,
    read_admin_keys,
    read_api_keys,
    read_internal_keys,
    read_key_limits,
    read_key_max_priority,
)
from strata.commands.tracing_flags import add_tracing_flags, start_tracing, tracing_config
from strata.errors import ConfigError
from strata.gateway.config import (
    PD_MODES,
    SESSION_ROUTING_MODES,
    AdapterPlacementConfig,
    AdmissionConfig,
    GatewayConfig,
    PDRoutingConfig,
    ResumeConfig,
    RetryConfig,
    SessionRoutingConfig,
    TenantConfig,
    VersionConfig,
)
from strata.gateway.control.intake import DEFAULT_MODEL_ROOTS
from strata.gateway.routing.policies import policy_names
from strata.gateway.routing.sources import InstanceSource, RegistrySource, StaticSource
from strata.logs import announce
from strata.protocol.auth import check_exposure
from strata.protocol.keys import auth_header
from strata.registry.models import ModelRegistry
from strata.registry.releases.policy import ReleaseConfig
from strata.state.urls import schemes_help

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds `strata gateway` and its flags."""
    p = sub.add_parser("gateway", help="route OpenAI requests over many instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--registry", default=None,
                   help=f"registry URL ({schemes_help('registry')}); default STRATA_REGISTRY")
    p.add_argument("--instances", nargs="+", default=None, metavar="URL",
                   help="static instance URLs instead of a registry")
    p.add_argument("--policy", choices=policy_names(), default="power_of_two",
                   help="routing policy (the table in strata/gateway/routing/policies/__init__.py)")
    p.add_argument("--max-in-flight", type=positive_int, default=256)
    p.add_argument("--max-queue", type=non_negative_int, default=512)
    p.add_argument("--queue-timeout-s", type=positive_float, default=10.0)
    p.add_argument("--start-wait-s", type=positive_float, default=60.0,
                   help="how long a request waits for room while instances are starting (an "
                        "autoscaler's new ones; the first with --min-replicas 0) instead of "
                        "--queue-timeout-s")
    p.add_argument("--max-retries", type=non_negative_int, default=2)
    p.add_argument("--max-resumes", type=non_negative_int, default=2,
                   help="a stream cut after its first byte goes on on another instance at most "
                        "this many times (0: never; the client gets an error event)")
    p.add_argument("--stall-s", type=positive_float, default=0.5,
                   help="an instance silent this long while a request waits on it is probed; "
                        "if the probe fails, its requests are resumed or retried elsewhere")
    p.add_argument("--stall-probe-timeout-s", type=positive_float, default=0.5)
    p.add_argument("--health-check-interval-s", type=positive_float, default=1.0)
    add_auth_flags(p)
    p.add_argument("--shutdown-timeout-s", type=positive_float, default=30.0)
    p.add_argument("--keep-alive-s", type=positive_float, default=75.0,
                   help="a client's idle kept-alive connection is closed after this long; keep "
                        "it above the clients' own idle expiry (httpx: 5 s)")
    p.add_argument("--session-routing", choices=SESSION_ROUTING_MODES, default="none",
                   help="requests with a session id: none/external (normal policy), sticky "
                        "(pinned, bounded-load consistent hash), hybrid (sticky; moves rebuild "
                        "from the session store)")
    p.add_argument("--session-store", default=None, metavar="URL",
                   help=f"pin table shared by every gateway ({schemes_help('pins')}); "
                        "default memory:// (this gateway only)")
    p.add_argument("--session-epsilon", type=positive_float, default=0.25,
                   help="bounded loads: an instance holds at most ceil((1+eps) * mean) sessions "
                        "(pinned ones; with --policy consistent_hash, also in-flight ones)")
    p.add_argument("--session-pin-ttl-s", type=positive_float, default=3600.0,
                   help="a pin unused this long expires")
    p.add_argument("--session-local-pin-age-s", type=non_negative_float, default=1.0,
                   help="reuse this gateway's placement of a session read or written this "
                        "recently instead of reading the shared pin table (0: every request)")
    p.add_argument("--adapter-spread", type=positive_float, default=2.0,
                   help="--policy adapter_aware: a LoRA adapter with share S of the requests "
                        "is placed on ceil(spread * S * instances) of them (at least one)")
    p.add_argument("--adapter-window-s", type=positive_float, default=30.0,
                   help="--policy adapter_aware: the window an adapter's share is measured over")
    p.add_argument("--adapter-shrink-after-s", type=positive_float, default=60.0,
                   help="--policy adapter_aware: an adapter's instances shrink only after its "
                        "share stayed this long under the level they were sized for / 1.25")
    p.add_argument("--routing-poll-s", type=positive_float, default=0.2,
                   help="how often the model registry's routing pointers are re-read (a "
                        "release's flip reaches this gateway within this interval)")
    p.add_argument("--version-pin-store", default=None, metavar="URL",
                   help=f"session -> version pins shared by every gateway ({schemes_help('pins')}; "
                        "default: --session-store, else the registry when SQLite or Redis)")
    p.add_argument("--release-lease-s", type=positive_float, default=10.0,
                   help="a release whose gateway stops renewing its lease this long is resumed "
                        "by another gateway (or this one, restarted)")
    p.add_argument("--release-ready-timeout-s", type=positive_float, default=600.0,
                   help="a release rolls back when its new instances are not ready by then")
    p.add_argument("--release-consistency", choices=("bounded", "strict"), default="bounded",
                   help="caches across a release: bounded (a flip reaches every gateway within "
                        "--routing-poll-s, unproven) or strict (a release's flip completes only "
                        "once every gateway's published view carries it or the gateway fenced "
                        "itself: a view not renewed for --routing-lease-s refuses routed "
                        "requests with a 503); docs/consistency.md")
    p.add_argument("--routing-lease-s", type=positive_float, default=2.0,
                   help="strict: how long this gateway routes on a view it could not renew (a "
                        "poll that read the registry and published its view); at least twice "
                        "--routing-poll-s")
    p.add_argument("--release-propagation-s", type=non_negative_float, default=1.0,
                   help="after a flip, how long before the old version retires (every gateway "
                        "re-reads the routing meanwhile; pinned sessions stay on it until then)")
    p.add_argument("--canary-window-s", type=positive_float, default=30.0,
                   help="how long a canary is watched before it is promoted")
    p.add_argument("--canary-min-requests", type=positive_int, default=20)
    p.add_argument("--canary-max-error-rate", type=float, default=0.05)
    p.add_argument("--canary-max-ttft-ratio", type=positive_float, default=2.0,
                   help="roll back when the canary's TTFT p99 exceeds this times the live one's")
    p.add_argument("--response-cache", default=None, metavar="URL",
                   help="opt-in cache of deterministic answers (temperature 0 or a seed), keyed "
                        f"by model version: {schemes_help('response_cache')}")
    p.add_argument("--response-cache-ttl-s", type=positive_float, default=600.0)
    _add_pd_flags(p)
    _add_usage_flags(p)
    p.add_argument("--model-root", action="append", default=None, metavar="ROOT",
                   help="where POST /admin/models may take models from, repeatable: alias:, "
                        "sim:, s3:, s3://BUCKET/PREFIX/ or an absolute directory (default: "
                        f"{' '.join(DEFAULT_MODEL_ROOTS)}); a version's serve_args come from "
                        "a fixed table of flags (strata/gateway/control/intake.py)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_tracing_flags(p)
    p.add_argument("--trace-url", default=None, metavar="TEMPLATE",
                   help="the dashboard links a slow request's trace id to this URL, "
                        "{trace_id} replaced (e.g. http://jaeger:16686/trace/{trace_id})")
    add_class_flags(p)
    add_autoscale_flags(p)


def _add_pd_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pd", choices=PD_MODES, default="auto",
                   help="prefill/decode disaggregation: auto (whenever prefill instances are "
                        "registered) or off")
    p.add_argument("--pd-min-uncached-tokens", type=non_negative_int,
                   default=PDRoutingConfig().min_uncached_tokens,
                   help="prefill remotely only prompts with at least this many uncached tokens "
                        "(estimated as bytes / 4); the default is fitted from the smollm2-cpu "
                        "profile and the measured hand-off overhead (docs/benchmarks.md)")
    p.add_argument("--pd-max-prefill-queue", type=positive_int, default=2,
                   help="prefill locally when the least loaded prefill instance has this many "
                        "requests queued or running")
    p.add_argument("--pd-prefill-timeout-s", type=positive_float, default=60.0,
                   help="a prefill instance slower than this: the decode instance prefills")


def _add_usage_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--usage-store", default=None, metavar="URL",
                   help="tenants' usage counts and rpm=/tpm= budget windows, shared by every "
                        f"gateway ({schemes_help('usage')}); default: the registry when Redis, "
                        "else memory:// (this gateway only)")
    p.add_argument("--usage-top-tenants", type=positive_int, default=TenantConfig().top_tenants,
                   help="/metrics labels this many tenants (most tokens first); the rest are "
                        "summed as tenant=\"other\"")
    p.add_argument("--usage-retention-s", type=positive_float,
                   default=TenantConfig().retention_s,
                   help="how long per-minute usage is kept for GET /admin/usage")


def _tenant_config(args: argparse.Namespace, env: CliEnv) -> TenantConfig:
    return TenantConfig(store_url=args.usage_store,
                        key_limits=read_key_limits(args.api_key_file, env),
                        top_tenants=args.usage_top_tenants, retention_s=args.usage_retention_s)


def build_config(args: argparse.Namespace, env: CliEnv) -> GatewayConfig:
    """The GatewayConfig the flags and environment describe."""
    registry = args.registry or (None if args.instances else env.registry_url)
    if not registry and not args.instances:
        raise ConfigError("give --registry URL or --instances URL [URL ...] "
                          "(or set STRATA_REGISTRY)")
    api_keys = read_api_keys(args.api_key_file, env.api_keys)
    admin_keys = read_admin_keys(args.admin_key_file, env.admin_keys)
    check_exposure("strata gateway", args.host, api_keys, admin_keys, insecure=args.insecure)
    if args.trace_url is not None and (
            "{trace_id}" not in args.trace_url
            or not args.trace_url.startswith(("http://", "https://"))):
        raise ConfigError(f"--trace-url wants an http(s) URL with {{trace_id}} in it, got "
                          f"{args.trace_url!r}")
    return GatewayConfig(
        host=args.host, port=args.port, policy=args.policy, trace_url=args.trace_url,
        instance_urls=tuple(args.instances or ()), registry_url=registry,
        health_check_interval_s=args.health_check_interval_s,
        retry=RetryConfig(max_retries=args.max_retries),
        resume=ResumeConfig(max_resumes=args.max_resumes, stall_s=args.stall_s,
                            stall_probe_timeout_s=args.stall_probe_timeout_s),
        admission=AdmissionConfig(max_in_flight=args.max_in_flight, max_queue=args.max_queue,
                                  queue_timeout_s=args.queue_timeout_s,
                                  start_wait_s=args.start_wait_s,
                                  batch_max_queue=args.batch_max_queue),
        classes=class_config(args),
        api_keys=api_keys, admin_keys=admin_keys,
        internal_keys=read_internal_keys(args.internal_key_file, env.internal_keys),
        key_max_priority=read_key_max_priority(args.api_key_file, env),
        rate_limit_per_s=args.rate_limit_per_s, shutdown_timeout_s=args.shutdown_timeout_s,
        keep_alive_s=args.keep_alive_s,
        sessions=_session_config(args),
        adapters=AdapterPlacementConfig(window_s=args.adapter_window_s,
                                        spread=args.adapter_spread,
                                        shrink_after_s=args.adapter_shrink_after_s),
        versions=VersionConfig(routing_poll_s=args.routing_poll_s,
                               routing_lease_s=args.routing_lease_s,
                               pin_store_url=args.version_pin_store,
                               release=_release_config(args)),
        response_cache_url=args.response_cache, response_cache_ttl_s=args.response_cache_ttl_s,
        model_roots=tuple(args.model_root or DEFAULT_MODEL_ROOTS),
        pd=PDRoutingConfig(mode=args.pd, min_uncached_tokens=args.pd_min_uncached_tokens,
                        max_prefill_queue=args.pd_max_prefill_queue,
                        prefill_timeout_s=args.pd_prefill_timeout_s),
        tenants=_tenant_config(args, env))


def _session_config(args: argparse.Namespace) -> SessionRoutingConfig:
    """Pins are only kept for sticky and hybrid; other modes ignore --session-store (the
    instances read history from their own --session-store)."""
    return SessionRoutingConfig(mode=args.session_routing, store_url=args.session_store,
                                epsilon=args.session_epsilon, pin_ttl_s=args.session_pin_ttl_s,
                                local_pin_max_age_s=args.session_local_pin_age_s)


def _release_config(args: argparse.Namespace) -> ReleaseConfig:
    return ReleaseConfig(ready_timeout_s=args.release_ready_timeout_s,
                         lease_s=args.release_lease_s, canary_window_s=args.canary_window_s,
                         canary_min_requests=args.canary_min_requests,
                         canary_max_error_rate=args.canary_max_error_rate,
                         canary_max_ttft_p99_ratio=args.canary_max_ttft_ratio,
                         propagation_s=args.release_propagation_s,
                         consistency=args.release_consistency)


def build_source(config: GatewayConfig,
                 control: httpx.AsyncClient) -> tuple[InstanceSource, Any | None]:
    """(source, a registry to close at exit or None). Static sources use `control`, the
    gateway's control-plane client (closed by the gateway)."""
    if config.registry_url:
        from strata.registry import create_registry

        registry = create_registry(config.registry_url)
        return RegistrySource(registry), registry
    return StaticSource(config.instance_urls, control), None


def build_model_registry(config: GatewayConfig) -> ModelRegistry | None:
    """The model registry at the instance registry's URL (versions, releases); none for a
    gateway over static instances."""
    if not config.registry_url:
        return None
    from strata.registry.models import create_model_registry

    return create_model_registry(config.registry_url)


def run(args: argparse.Namespace, env: CliEnv) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit code."""
    config = build_config(args, env)
    start_tracing(tracing_config(args, "strata-gateway"))
    return aio.run(_serve(config, args, time.perf_counter()))


async def _serve(config: GatewayConfig, args: argparse.Namespace, started: float) -> int:
    import uvicorn

    from strata.gateway.app import create_gateway_app
    from strata.gateway.control.releases import controller_owner

    # the control plane's calls to instances (model and load of static ones, warm-ups) carry
    # the fleet's internal key; a fleet without one, the first client key
    control = httpx.AsyncClient(timeout=httpx.Timeout(config.health_timeout_s),
                                headers=auth_header(config.internal_key or config.client_key))
    log_level = args.log_level
    source, registry = build_source(config, control)
    models = build_model_registry(config)
    autoscaler = build_autoscaler(args, models, controller_owner(config.port))
    app = create_gateway_app(config, source, control_client=control, models=models,
                             instance_registry=registry, autoscaler=autoscaler)
    tune_gc()
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level,
        access_log=log_level == "debug", log_config=None,  # through strata/logs.py's handler
        timeout_graceful_shutdown=math.ceil(config.shutdown_timeout_s),
        timeout_keep_alive=math.ceil(config.keep_alive_s)))
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; absorb it: exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    announce = asyncio.create_task(_announce(server, config, started))
    try:
        await server.serve()
    finally:
        announce.cancel()
        if registry is not None:
            await registry.close()
        if models is not None:
            await models.close()
    return 0


def tune_gc() -> None:
    """Keeps the collector off the request path: what start-up built lives as long as the
    process, so it is moved out of the collector's sight (`gc.freeze`), and the young generation
    is collected every 20,000 net allocations instead of 700. A request allocates few objects
    that outlive it, so collections become rare: at 64 streams, GC time fell from ~0.7 s (two
    full collections of ~0.25 s each, on the request path) to ~0.05 s per 1,280 requests."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


async def _announce(server: Any, config: GatewayConfig, started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
    ready_s = time.perf_counter() - started
    announce(f"Strata gateway on http://{config.host}:{port} (ready in {ready_s:.1f}s)")


__all__ = ["add_parser", "build_config", "read_api_keys", "run", "tune_gc"]
