"""Configuration of the gateway: frozen dataclasses, one per concern, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import ConfigError
from strata.gateway.control.intake import DEFAULT_MODEL_ROOTS, check_roots
from strata.protocol.budgets import KeyLimits
from strata.protocol.keys import Keys
from strata.registry.releases.policy import ReleaseConfig
from strata.state.urls import scheme_of
from strata.types import PriorityClass

SESSION_ROUTING_MODES = ("none", "external", "sticky", "hybrid")


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")


@dataclass(frozen=True, slots=True)
class EjectionConfig:
    """Passive outlier ejection: `consecutive_failures` in a row eject an instance for
    `base_ejection_s * 2**k` (k = earlier ejections, capped at `max_ejection_s`); never more than
    `max_ejected_fraction` of the fleet is ejected at once."""

    consecutive_failures: int = 3
    base_ejection_s: float = 2.0
    max_ejection_s: float = 60.0
    max_ejected_fraction: float = 0.5

    def __post_init__(self) -> None:
        _positive(self, "consecutive_failures", "base_ejection_s", "max_ejection_s")
        if self.max_ejection_s < self.base_ejection_s:
            raise ConfigError("max_ejection_s must be >= base_ejection_s")
        if not 0.0 <= self.max_ejected_fraction <= 1.0:
            raise ConfigError(f"max_ejected_fraction must be in [0, 1], "
                              f"got {self.max_ejected_fraction}")


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Retries before the first byte: at most `max_retries` per request, backoff
    `backoff_base_s * 2**attempt` (capped), and a budget: over `budget_window_s`, retries may
    not exceed `budget_ratio` of requests plus `budget_min_per_s` per second."""

    max_retries: int = 2
    backoff_base_s: float = 0.02
    backoff_max_s: float = 1.0
    budget_ratio: float = 0.2
    budget_min_per_s: float = 3.0
    budget_window_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.backoff_base_s < 0 or self.budget_ratio < 0 or self.budget_min_per_s < 0:
            raise ConfigError("backoff_base_s, budget_ratio and budget_min_per_s must be >= 0")
        _positive(self, "backoff_max_s", "budget_window_s")


@dataclass(frozen=True, slots=True)
class ResumeConfig:
    """Streams that outlive their instance (strata/gateway/upstream/resume.py, stalls.py). A stream
    cut after its first byte goes on on another instance at most `max_resumes` times (0: never; the
    client gets an error event). An attempt whose instance has sent nothing for `stall_s` while
    the gateway waits is checked: a `/health` probe that fails within `stall_probe_timeout_s`
    ends it (resumed, or retried when nothing was sent yet); stalls are looked for every
    `stall_sweep_s`."""

    max_resumes: int = 2
    stall_s: float = 0.5
    stall_probe_timeout_s: float = 0.5
    stall_sweep_s: float = 0.25

    def __post_init__(self) -> None:
        if self.max_resumes < 0:
            raise ConfigError(f"max_resumes must be >= 0, got {self.max_resumes}")
        _positive(self, "stall_s", "stall_probe_timeout_s", "stall_sweep_s")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """At most `max_in_flight` proxied requests; up to `max_queue` more wait (by class, FIFO in
    a class) for at most `queue_timeout_s`, of them at most `batch_max_queue` batch requests
    (sheddable ones never wait). A full queue answers 429, a timeout 503, with Retry-After.
    While instances start (an autoscaler's, the first of a fleet at zero), a request waiting for
    room in a pool waits up to `start_wait_s` instead (strata/gateway/path/start_wait.py)."""

    max_in_flight: int = 256
    max_queue: int = 512
    queue_timeout_s: float = 10.0
    start_wait_s: float = 60.0
    retry_after_s: float = 1.0
    batch_max_queue: int = 128

    def __post_init__(self) -> None:
        _positive(self, "max_in_flight", "queue_timeout_s", "retry_after_s", "start_wait_s")
        if self.max_queue < 0 or self.batch_max_queue < 0:
            raise ConfigError(f"max_queue and batch_max_queue must be >= 0, got "
                              f"{self.max_queue} and {self.batch_max_queue}")


@dataclass(frozen=True, slots=True)
class ClassConfig:
    """Priority classes routed to pools, with flow control (strata/gateway/path/classes.py).
    `class_pools`: (class, pool) pairs; `instance_slots`: requests one routable instance takes
    at once (0: no cap); `hold_without_instances`: requests wait (up to the queue timeout)
    while no instance can take them, as when an autoscaler starts the first one."""

    class_pools: tuple[tuple[str, str], ...] = ()
    instance_slots: int = 0
    hold_without_instances: bool = False
    recheck_s: float = 0.05  # how often waiters look for room that did not come from a release

    def __post_init__(self) -> None:
        names = [klass.label for klass in PriorityClass]
        for klass, pool in self.class_pools:
            if klass not in names or not pool:
                raise ConfigError(f"--class-pool wants CLASS=POOL with CLASS one of "
                                  f"{', '.join(names)}; got {klass}={pool}")
        if self.instance_slots < 0:
            raise ConfigError(f"instance_slots must be >= 0, got {self.instance_slots}")
        _positive(self, "recheck_s")

    @property
    def is_on(self) -> bool:
        return bool(self.class_pools or self.instance_slots or self.hold_without_instances)


@dataclass(frozen=True, slots=True)
class SessionRoutingConfig:
    """How requests carrying a session id are routed (`mode`, see strata/gateway/path/sessions.py).
    `store_url` holds the pin table shared by every gateway (None: in this process only);
    `epsilon` bounds each instance to ceil((1+epsilon) * mean) pinned sessions; `epsilon` and
    `num_vnodes` (ring points per instance) also shape the `consistent_hash` policy; a pin
    unused for `pin_ttl_s` expires. A placement this gateway read or wrote in the store less than
    `local_pin_max_age_s` ago is reused without reading the store again (0: read every time)."""

    mode: str = "none"
    store_url: str | None = None
    epsilon: float = 0.25
    num_vnodes: int = 100
    pin_ttl_s: float = 3600.0
    counts_max_age_s: float = 1.0
    local_pin_max_age_s: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in SESSION_ROUTING_MODES:
            raise ConfigError(f"unknown session routing {self.mode!r}; "
                              f"valid: {', '.join(SESSION_ROUTING_MODES)}")
        _positive(self, "epsilon", "num_vnodes", "pin_ttl_s")
        if self.counts_max_age_s < 0:
            raise ConfigError(f"counts_max_age_s must be >= 0, got {self.counts_max_age_s}")
        if self.local_pin_max_age_s < 0:
            raise ConfigError(f"local_pin_max_age_s must be >= 0, "
                              f"got {self.local_pin_max_age_s}")

    @property
    def is_pinning(self) -> bool:
        """Whether sessions are pinned to instances (sticky or hybrid)."""
        return self.mode in ("sticky", "hybrid")


@dataclass(frozen=True, slots=True)
class AdapterPlacementConfig:
    """How `--policy adapter_aware` places LoRA adapters (policies/adapter_aware.py). An
    adapter's demand is its share of the requests of the last `window_s` (exponentially
    weighted); it is placed on k = ceil(spread * share * instances) instances, at least one. k
    grows at once; it shrinks only once the share has stayed under the level k was sized for,
    divided by (1 + hysteresis), for `shrink_after_s`. An instance the gateway sent an adapter
    to counts as holding it for `warm_s` (until its own report says so or not)."""

    window_s: float = 30.0
    spread: float = 2.0
    hysteresis: float = 0.25
    shrink_after_s: float = 60.0
    warm_s: float = 5.0
    min_requests: float = 64.0  # a share is of at least this many requests (a cold start)

    def __post_init__(self) -> None:
        _positive(self, "window_s", "spread", "hysteresis", "shrink_after_s", "warm_s",
                  "min_requests")


@dataclass(frozen=True, slots=True)
class VersionConfig:
    """Version routing and releases (on when the gateway has a model registry).

    `pin_store_url` holds the session -> version pins every gateway shares (None: the session
    routing store, else the registry's URL when it is SQLite or Redis, else this process)."""

    routing_poll_s: float = 0.2
    pin_store_url: str | None = None
    pin_ttl_s: float = 86_400.0
    stats_window_s: float = 60.0  # at most; see `health_window_s`
    health_publish_s: float = 1.0  # while a canary runs: this gateway's window to the registry
    warm_timeout_s: float = 120.0
    # --release-consistency strict: routing that was not renewed (a poll that read the registry
    # and published this gateway's view) for this long refuses what the routing decides
    routing_lease_s: float = 2.0
    release: ReleaseConfig = field(default_factory=ReleaseConfig)  # timeouts, lease, canary

    def __post_init__(self) -> None:
        _positive(self, "routing_poll_s", "pin_ttl_s", "stats_window_s", "health_publish_s",
                  "warm_timeout_s", "routing_lease_s")
        if self.is_strict and self.routing_lease_s < 2 * self.routing_poll_s:
            raise ConfigError(
                f"--routing-lease-s ({self.routing_lease_s:g}) must be at least twice "
                f"--routing-poll-s ({self.routing_poll_s:g}) with --release-consistency strict: "
                "a gateway refuses routed requests once it has not renewed its view for the "
                "lease, so one slow poll must not fence it")
        if self.release.propagation_s < self.routing_poll_s:
            raise ConfigError(
                f"--release-propagation-s ({self.release.propagation_s:g}) must be at least "
                f"--routing-poll-s ({self.routing_poll_s:g}): the old version retires that long "
                "after a flip, and a gateway that has not polled since the flip still sends "
                "requests to it")

    @property
    def is_strict(self) -> bool:
        return self.release.consistency == "strict"

    @property
    def health_window_s(self) -> float:
        """How far back a version's requests count: never longer than a canary's window, so
        that the canary is compared with live over the same recent period (not with a live p99
        inflated before the canary began, e.g. while the canary's instances started)."""
        return min(self.stats_window_s, self.release.canary_window_s)


PD_MODES = ("auto", "off")


@dataclass(frozen=True, slots=True)
class PDRoutingConfig:
    """The prefill/decode hand-off (strata/gateway/routing/pd.py). `mode` auto: the step is on the
    path and disaggregates whenever the fleet has routable prefill instances (`strata gateway`'s
    default); off: no step (the default of a gateway built in code: only the steps it asks
    for). A request is prefilled remotely when its estimated uncached prompt tokens reach
    `min_uncached_tokens` and the chosen (else the least loaded) prefill instance has fewer than
    `max_prefill_queue` requests queued or running; P must answer within `prefill_timeout_s`,
    else D prefills locally."""

    mode: str = "off"
    min_uncached_tokens: int = 368  # sim.transfer.fit_min_uncached_tokens: smollm2-cpu, 15 ms
    max_prefill_queue: int = 2
    prefill_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in PD_MODES:
            raise ConfigError(f"unknown --pd mode {self.mode!r}; valid: {', '.join(PD_MODES)}")
        if self.min_uncached_tokens < 0 or self.max_prefill_queue < 1:
            raise ConfigError("min_uncached_tokens must be >= 0 and max_prefill_queue >= 1")
        _positive(self, "prefill_timeout_s")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """Usage per tenant and the client keys' budgets (strata/gateway/tenants/). `store_url`
    holds the counts and budget windows every gateway shares (None: the registry when it is
    Redis, else this gateway only); `key_limits` are the key file's rpm=/tpm= fields;
    `/metrics` labels the `top_tenants` tenants (and `top_models` models) with the most
    tokens, the rest as "other"."""

    store_url: str | None = None
    key_limits: tuple[tuple[str, KeyLimits], ...] = ()
    top_tenants: int = 10
    top_models: int = 20
    retention_s: float = 86400.0

    def __post_init__(self) -> None:
        _positive(self, "top_tenants", "top_models")
        if self.store_url is not None:
            scheme_of("usage", self.store_url)  # an unknown URL: the forms it could be
        if self.retention_s < 60:
            raise ConfigError(f"usage retention_s must be at least 60, got {self.retention_s}")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything `strata gateway` needs; instances come from `registry_url` or
    `instance_urls` (at most one of them; an app built with its own instance source needs
    neither). `policy` names a row of the policy table
    (strata/gateway/routing/policies/__init__.py), checked when the gateway is built (the table may
    gain rows after this config is made)."""

    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "power_of_two"
    instance_urls: tuple[str, ...] = ()
    registry_url: str | None = None
    trace_url: str | None = None  # the dashboard's link to a trace: "{trace_id}" in it
    poll_interval_s: float = 0.5
    health_check_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 120.0
    max_connections: int = 1000
    ejection: EjectionConfig = field(default_factory=EjectionConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    classes: ClassConfig = field(default_factory=ClassConfig)
    api_keys: tuple[str, ...] = ()  # client keys
    admin_keys: tuple[str, ...] = ()  # for /admin/*
    internal_keys: tuple[str, ...] = ()  # the fleet's (strata/protocol/keys.py): the first is
    # sent to instances on every call, client identity beside it, and seals hand-off handles
    rate_limit_per_s: float | None = None
    key_max_priority: tuple[tuple[str, int], ...] = ()  # (key, priority ceiling) pairs
    shutdown_timeout_s: float = 30.0
    # how long a client's idle kept-alive connection stays open: above the idle expiry of the
    # common clients (httpx 5 s, aiohttp 15 s), so that a client never sends on a connection
    # the gateway is closing at that moment (that request would fail with no answer); nginx's 75
    keep_alive_s: float = 75.0
    sessions: SessionRoutingConfig = field(default_factory=SessionRoutingConfig)
    adapters: AdapterPlacementConfig = field(default_factory=AdapterPlacementConfig)
    versions: VersionConfig = field(default_factory=VersionConfig)
    response_cache_url: str | None = None  # opt-in: deterministic answers, keyed by version
    response_cache_ttl_s: float = 600.0
    pd: PDRoutingConfig = field(default_factory=PDRoutingConfig)  # prefill/decode disaggregation
    tenants: TenantConfig = field(default_factory=TenantConfig)  # usage, budgets
    model_roots: tuple[str, ...] = DEFAULT_MODEL_ROOTS  # what POST /admin/models may register

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.instance_urls and self.registry_url:
            raise ConfigError("give either --registry or --instances, not both")
        for url in self.instance_urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"instance URL {url!r} must start with http:// or https://")
        _positive(self, "poll_interval_s", "health_check_interval_s", "health_timeout_s",
                  "connect_timeout_s", "read_timeout_s", "max_connections")
        if self.rate_limit_per_s is not None and self.rate_limit_per_s <= 0:
            raise ConfigError(f"rate_limit_per_s must be positive, got {self.rate_limit_per_s}")
        _positive(self, "response_cache_ttl_s")
        Keys(self.api_keys, self.admin_keys, self.internal_keys)  # validates them
        unknown = {key for key, _ in self.tenants.key_limits} - set(self.api_keys)
        if unknown:
            raise ConfigError(f"{len(unknown)} key(s) with rpm=/tpm= limits are not client keys; "
                              "limits go beside a key of --api-key-file")
        check_roots(self.model_roots)

    @property
    def internal_key(self) -> str | None:
        """The key this gateway sends to instances (None: a fleet without one)."""
        return self.internal_keys[0] if self.internal_keys else None

    @property
    def client_key(self) -> str | None:
        """Without an internal key, what the gateway's own calls to instances carry: a fleet
        whose instances take client keys alone still answers them."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def version_pin_store_url(self) -> str:
        """Where session -> version pins live: --version-pin-store, else the session routing
        store, else the registry when it is shared (SQLite, Redis), else this process."""
        url = self.versions.pin_store_url or self.sessions.store_url
        if url is None and self.registry_url and not self.registry_url.startswith("memory"):
            url = self.registry_url
        return url or "memory://"

    @property
    def usage_store_url(self) -> str:
        """Where tenants' usage and budget windows live: --usage-store, else the registry when
        it is Redis (every gateway of the fleet adds up there), else this process. An SQLite
        registry is not the default: a JSON answer waits for its usage write, which there is a
        file commit; `--usage-store sqlite:///PATH` shares one on a machine by choice."""
        url = self.tenants.store_url
        if url is None and self.registry_url and self.registry_url.startswith("redis"):
            url = self.registry_url
        return url or "memory://"


__all__ = ["PD_MODES", "SESSION_ROUTING_MODES", "AdapterPlacementConfig", "AdmissionConfig",
           "ClassConfig", "PDRoutingConfig",
           "EjectionConfig", "GatewayConfig", "ResumeConfig", "RetryConfig",
           "SessionRoutingConfig", "TenantConfig", "VersionConfig"]
