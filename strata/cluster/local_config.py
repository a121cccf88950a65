"""What `strata up` starts on one machine (LocalClusterConfig) and each instance's command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata.cluster.deployments import serve_model_args
from strata.errors import ConfigError
from strata.registry.models import ModelVersion
from strata.registry.models.deployments import DEFAULT_POOL, MIXED, PoolSize


@dataclass(frozen=True, slots=True)
class LocalClusterConfig:
    """What `strata up` starts. `serve_args` are passed through to every `strata serve`
    (less --simulate, --model-version and --served-model-name: each version decides those)."""

    replicas: int
    run_dir: Path
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    serve_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    restart_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 30.0  # an instance up this long has its backoff reset
    stop_timeout_s: float = 30.0
    threads_per_instance: int | None = None
    registry: str | None = None  # default: SQLite in run_dir (one machine)
    reconcile_interval_s: float = 0.5
    is_autoscaled: bool = False  # the gateway's autoscaler sizes it: it may start with none
    num_prefill: int = 0  # `--prefill N`: seeded as a prefill pool of N, a decode pool of the rest
    class_pools: tuple[tuple[str, int], ...] = ()  # `--pool NAME=N`: of `replicas`, N in NAME

    def __post_init__(self) -> None:
        if self.replicas < (0 if self.is_autoscaled else 1):
            raise ConfigError(f"--replicas must be >= 1 (0 only with --autoscale "
                              f"--min-replicas 0), got {self.replicas}")
        if self.restart_backoff_s <= 0 or self.max_backoff_s < self.restart_backoff_s:
            raise ConfigError("restart backoff must be > 0 and <= the maximum backoff")
        if self.reconcile_interval_s <= 0:
            raise ConfigError(f"reconcile_interval_s must be > 0: {self.reconcile_interval_s}")
        if self.num_prefill and not 0 < self.num_prefill < self.num_base:
            raise ConfigError(f"a prefill/decode cluster needs a decode instance too: "
                              f"{self.num_prefill} prefill of {self.num_base} instances")
        if self.num_base < 0 or any(n < 1 for _, n in self.class_pools):
            raise ConfigError(f"--pool NAME=N wants N >= 1 within --replicas: {self.class_pools}")

    @property
    def num_base(self) -> int:
        """Instances outside the named pools (`--pool`)."""
        return self.replicas - sum(n for _, n in self.class_pools)

    @property
    def pools(self) -> tuple[PoolSize, ...]:
        """The pools `strata up` seeds (none: one mixed pool of `replicas`)."""
        named = tuple(PoolSize(pool=name, replicas=n) for name, n in self.class_pools)
        if self.num_prefill:
            return (PoolSize("prefill", replicas=self.num_prefill),
                    PoolSize("decode", replicas=self.num_base - self.num_prefill), *named)
        return (PoolSize(replicas=self.num_base), *named) if named else ()

    @property
    def registry_url(self) -> str:
        return self.registry or local_registry_url(self.run_dir)

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"


def local_registry_url(run_dir: Path) -> str:
    """The one-machine registry of `strata up` in `run_dir`: the default of `up` and `status`."""
    return f"sqlite:///{run_dir.resolve() / 'registry.db'}"


def instance_argv(config: LocalClusterConfig, version: ModelVersion, instance_id: str,
                  port: int | None, python: str, index: int = 0, *, role: str = MIXED,
                  pool: str = DEFAULT_POOL) -> list[str]:
    """The `strata serve` command line of instance `index` of `version` in the cluster, in
    `role` and `pool`, listening on `port` of the cluster's host (None: without where it
    listens; the caller adds `listen_args`)."""
    c = config
    argv = [python, "-m", "strata.cli", "serve", *serve_model_args(version, c.serve_args),
            "--registry", c.registry_url, "--instance-id", instance_id,
            *(listen_args(c.host, port) if port is not None else [])]
    argv += ["--role", role] if role != MIXED else []
    argv += ["--pool", pool] if pool != DEFAULT_POOL else []
    if c.threads_per_instance and not version.is_simulated:
        argv += ["--threads", str(c.threads_per_instance)]
    return argv


def listen_args(host: str, port: int) -> list[str]:
    """Where a `strata serve` listens, and the URL it registers: the same address."""
    return ["--host", host, "--port", str(port), "--advertise-url", f"http://{host}:{port}"]


__all__ = ["LocalClusterConfig", "instance_argv", "listen_args", "local_registry_url"]
