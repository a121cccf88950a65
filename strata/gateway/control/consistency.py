"""GET /admin/consistency: for each kind of state, the consistency this gateway runs with.

One row per state (docs/consistency.md is the long form, with the code behind each rule): where
it lives as this gateway is configured, the level in force, what a client can observe, the
staleness bound in seconds where there is one (null: read from its store on every use, or
not bounded), and what a failure costs. The rows are computed from the gateway's own settings,
so a flag changes its row (a shared pin store instead of this process's memory, a poll
interval, a response-cache TTL). State kept by the instances (session history, the KV store,
P/D leases) is described by the rule the instances follow; its flags are theirs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.gateway.config import GatewayConfig
from strata.gateway.wiring import Gateway
from strata.state.urls import SENTINEL_PREFIX


@dataclass(frozen=True, slots=True)
class StateConsistency:
    state: str
    store: str
    level: str
    observe: str
    staleness_bound_s: float | None
    after_failure: str


def _store(url: str | None, *, absent: str = "memory of this gateway") -> str:
    """A store as the table names it: its backend and whether gateways share it."""
    if url is None or url in ("memory", "memory://"):
        return absent
    if url.startswith(SENTINEL_PREFIX):
        return "Redis behind Sentinels (shared, follows a failover)"
    if url.startswith(("redis://", "rediss://")):
        return "Redis (shared)"
    if url.startswith("sqlite://"):
        return "SQLite (shared on this machine)"
    return url.split("://")[0]


def consistency_table(config: GatewayConfig) -> list[StateConsistency]:
    sessions = config.sessions
    pins_shared = sessions.store_url not in (None, "memory", "memory://")
    version_pins = config.version_pin_store_url
    rows = [
        StateConsistency(
            "session_history", "the instances' --session-store",
            "chosen per instance by --session-consistency: strong (default; each turn a "
            "compare-and-set on the store before it is acknowledged), session (acknowledged "
            "from the instance's memory, written behind within --session-flush-bound-ms), "
            "eventual (written behind, bounded by --session-write-queue); each instance's "
            "level and lag on its /metrics (strata:session_write_*)",
            "strong: read-your-writes everywhere, a turn that lost a race is a 409; session: "
            "read-your-writes through the pinned instance, another instance reads up to the "
            "bound behind; eventual: another instance misses at most the queue's turns", None,
            "store down: strong 503 and nothing stored; session/eventual go on for sessions "
            "with queued turns until the bound or the queue refuses (503), never drop; "
            "instance crash: strong loses nothing "
            "acknowledged, session the turns of the last bound, eventual the queue; a Redis "
            "crash keeps acknowledged turns with --session-redis-appendfsync always, a "
            "Sentinel failover with --session-redis-replicas >= 1"),
        StateConsistency(
            "session_pins",
            _store(sessions.store_url) if sessions.is_pinning else "off",
            ("eventual across gateways: placement by compare-and-set, the loser follows the "
             "winner" if pins_shared else "this gateway only") if sessions.is_pinning else "off",
            "a session's turns stay on one instance while it lives",
            sessions.local_pin_max_age_s if sessions.is_pinning else None,
            "store down: bounded consistent hash, unpinned; instance gone: re-placed by "
            "compare-and-set" if sessions.is_pinning else "-"),
        StateConsistency(
            "version_pins", _store(version_pins),
            "strong per session: the first writer's version wins (set-if-absent)"
            if version_pins != "memory://" else "this gateway only",
            "a session keeps the version of its first turn through a release", None,
            "store down: the live version; gateway gone: pins in its memory are lost"
            if version_pins == "memory://" else "store down: the live version"),
        _routing_row(config),
        StateConsistency(
            "instance_registry", _store(config.registry_url, absent="none (--instances)"),
            "eventual, bounded: polled; a record is dead 5 s after its last heartbeat",
            "a new instance is routed within the poll; a dead one within the heartbeat timeout "
            "(sooner through failed requests)", config.poll_interval_s,
            "store down: the last view"),
        StateConsistency(
            "prefix_index", "memory of this gateway, fed by the instances' block events"
            if config.policy == "cache_aware" else "off",
            "eventual: events ordered by (epoch, seq), newest wins"
            if config.policy == "cache_aware" else "off",
            "routing hints only: a wrong guess costs a recompute, never a wrong answer",
            0.5 if config.policy == "cache_aware" else None,
            "instance gone: its blocks forgotten; gateway restart: rebuilt from snapshots"
            if config.policy == "cache_aware" else "-"),
        StateConsistency(
            "response_cache", _store(config.response_cache_url, absent="off"),
            "bounded by the TTL; keys carry model and version"
            if config.response_cache_url else "off",
            "an answer up to the TTL old, never another version's",
            config.response_cache_ttl_s if config.response_cache_url else None,
            "store down: served uncached" if config.response_cache_url else "-"),
        StateConsistency(
            "kv_store", "the instances' --kv-store",
            "content-addressed: a block's key is the hash of its tokens, model and version",
            "a block is never stale, only missing (then recomputed)", None,
            "store down: recomputed; a publish in flight is lost"),
        StateConsistency(
            "pd_leases", "memory of each prefill instance" if config.pd.mode != "off" else "off",
            "local: a prefill instance holds blocks until pulled or the lease ends",
            "a hand-off either imports the blocks or recomputes the prompt", None,
            "prefill gone: the decode side recomputes; decode gone: blocks freed"
            if config.pd.mode != "off" else "-"),
        _usage_row(config),
    ]
    return rows


def _routing_row(config: GatewayConfig) -> StateConsistency:
    """Model routing and releases at --release-consistency strict or bounded."""
    versions, store = config.versions, _store(config.registry_url, absent="none (--instances)")
    if versions.is_strict:
        return StateConsistency(
            "model_routing_and_releases", store,
            "strict: a release's flip completes only once every gateway's published routing "
            "view carries it or the gateway fenced itself (its view not renewed for "
            "--routing-lease-s); the old version's answers, response-cache entries included, "
            "go only to requests sent before that",
            "no request sent after a flip completed is routed to the old version (a session "
            "pinned to it or an explicit version excepted); a gateway that cannot read the "
            "registry for the lease answers routed requests 503 (Retry-After) until it can",
            0.0,
            f"registry down: this gateway refuses routed requests {versions.routing_lease_s:g} "
            "s after its last renewed view, and a release's flip waits that long for it; "
            "gateway gone: the same wait, its release lease lapses and another gateway "
            "resumes the release")
    return StateConsistency(
        "model_routing_and_releases", store,
        "bounded: each gateway polls the registry",
        "a release's flip reaches every gateway within the poll; the old version retires "
        f"{versions.release.propagation_s:g} s after the flip (never before a poll)",
        versions.routing_poll_s,
        "registry down: the last view stays (unbounded); gateway gone: its release lease "
        "lapses and another gateway resumes the release")


def _usage_row(config: GatewayConfig) -> StateConsistency:
    url = config.usage_store_url
    return StateConsistency(
        "tenant_usage_and_budgets", _store(url),
        "atomic per one-minute window across gateways: a request is admitted and counted in "
        "one step; counts only add" if url != "memory://" else "this gateway only",
        "usage summed per minute on /admin/usage; a key passes its tpm by at most the tokens "
        "of its requests in flight", None,
        "store down: requests go on unmetered (strata:gateway_errors_total "
        "reason=usage_store); gateway gone: its answers in flight are not counted")


async def consistency(request: Request) -> Response:
    gateway: Gateway = request.app.state.gateway
    rows = consistency_table(gateway.config)
    return JSONResponse({"states": [asdict(row) for row in rows],
                         "docs": "docs/consistency.md"})


__all__ = ["StateConsistency", "consistency", "consistency_table"]
