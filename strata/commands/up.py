"""`strata up`: N instances behind the gateway, where `strata serve` would listen.

Before it starts anything it seeds the registry (strata/cluster/seed.py): the flags' model
becomes NAME@VERSION in the catalogue (NAME: the name `strata serve` would serve it under;
VERSION: --model-version, default "default"), deployed with --replicas instances and live. Once
the cluster is ready it writes {run_dir}/cluster.json (gateway and registry URLs, pid), which
`strata models|release|rollback` read to find the local cluster; stopping removes it. Keys: the
fleet's internal key is made per run unless given, and an admin key when client keys come
without one (strata/commands/run_keys.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from strata.cluster.deployments import VERSION_FLAGS
from strata.cluster.local import LocalClusterConfig, Supervisor
from strata.cluster.seed import ClusterSeed, seed_registry
from strata.commands import up_parallel
from strata.commands.argtypes import (
    non_negative_float,
    non_negative_int,
    one_of,
    port_number,
    positive_float,
    positive_int,
)
from strata.commands.autoscale_flags import add_autoscale_flags, gateway_args
from strata.commands.cluster_file import check_not_running, cluster_file, write_cluster_file
from strata.commands.env import CliEnv, read_admin_keys, read_api_keys, read_internal_keys
from strata.commands.run_keys import NO_RUN_KEYS, RunKeys
from strata.commands.tracing_flags import TRACING_FLAGS, tracing_args
from strata.commands.up_roles import (
    PD_SERVE_FLAGS,
    add_role_flags,
    cluster_shape,
    describe_roles,
)
from strata.errors import ConfigError, StrataError
from strata.logs import announce
from strata.protocol.auth import check_exposure
from strata.registry.models import ModelVersion
from strata.state.sessions.base import CONSISTENCY_LEVELS
from strata.store.manifest import local_manifest_sha256


class Launcher(Protocol):
    """The local supervisor and the Ray launcher alike."""

    def start(self) -> None: ...

    def poll(self) -> None: ...

    def stop(self) -> None: ...

    def run_forever(self, should_stop: Callable[[], bool], interval_s: float = 0.5) -> None: ...


log = logging.getLogger("strata.up")

# flags of `strata serve` that `strata up` passes through to every instance
_SERVE_FLAGS: tuple[tuple[str, Any], ...] = (
    ("--served-model-name", str), ("--model-version", str), ("--dtype", str),
    ("--max-model-len", positive_int), ("--kv-cache-gb", positive_float),
    ("--block-size", positive_int), ("--max-num-seqs", positive_int), ("--simulate", str),
    ("--session-store", str), ("--session-consistency", one_of(*CONSISTENCY_LEVELS)),
    ("--session-flush-bound-ms", positive_float), ("--session-write-queue", positive_int),
    ("--session-redis-replicas", non_negative_int), ("--sim-start-s", non_negative_float),
    ("--max-queue-wait-s", non_negative_float), *PD_SERVE_FLAGS, *up_parallel.SERVE_FLAGS,
    *TRACING_FLAGS,  # the gateway gets them too (_config)
)
_SERVE_SWITCHES = ("--deterministic",)  # `strata serve` switches, likewise passed through


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start N instances behind the gateway on one machine")
    p.add_argument("model", nargs="?", default=None, help="as for `strata serve`")
    p.add_argument("--replicas", type=non_negative_int, default=None,
                   help="instances to start with (default 2; with --autoscale, "
                        "--min-replicas, and 0 only then)")
    add_role_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="the gateway's port")
    p.add_argument("--policy", default=None, help="gateway routing policy")
    p.add_argument("--release-consistency", choices=("bounded", "strict"), default=None,
                   help="the gateway's --release-consistency (default bounded)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="one more `strata gateway` flag, repeatable "
                        "(e.g. --gateway-arg=--max-in-flight=64)")
    p.add_argument("--threads-per-instance", type=positive_int, default=None,
                   help="torch threads per instance, shared by its ranks (default: cores/replicas)")
    p.add_argument("--ready-timeout-s", type=positive_float, default=600.0)
    p.add_argument("--log-level", default="info")
    p.add_argument("--registry", default=None,
                   help="registry URL (default: $STRATA_REGISTRY, else SQLite in the run dir; "
                        "Redis for several nodes)")
    p.add_argument("--ray", action="store_true", help="run the instances as Ray actors")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (e.g. auto, HOST:6379; default: start a local Ray "
                        "on the loopback)")
    p.add_argument("--placement", choices=("spread", "pack"), default="spread",
                   help="with --ray: spread the replicas over the nodes (default) or pack them")
    p.add_argument("--num-cpus-per-instance", type=positive_float, default=0.5,
                   help="Ray CPUs per instance, shared by its ranks (fractions allowed)")
    for flag, kind in _SERVE_FLAGS:
        p.add_argument(flag, *up_parallel.SHORT_FLAGS.get(flag, ()), type=kind, default=None,
                       help="passed to every instance")
    for flag in _SERVE_SWITCHES:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                       help="passed to every instance")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="client API keys, one per line: passed to the gateway and every instance "
                        "(STRATA_API_KEYS, inherited, adds more)")
    p.add_argument("--admin-key-file", type=Path, default=None,
                   help="admin key(s) for /admin/*: passed to the gateway and every instance "
                        "(STRATA_ADMIN_KEYS, inherited, adds more); with client keys and none "
                        "given, a new one for this run in {run_dir}/keys/admin.key (0600), "
                        "which `strata models|release|rollback` here find")
    p.add_argument("--internal-key-file", type=Path, default=None,
                   help="the fleet's internal key(s) (STRATA_INTERNAL_KEYS, inherited, adds "
                        "more); default: a new key for this run in {run_dir}/keys/internal.key "
                        "(0600), removed at stop")
    p.add_argument("--insecure", action="store_true",
                   help="allow --host beyond the loopback without keys (passed through)")
    add_autoscale_flags(p)


def run(args: argparse.Namespace, env: CliEnv) -> int:
    if args.simulate and args.deterministic:
        raise ConfigError("--deterministic picks the model's kernels; simulated instances run "
                          "no model kernels: drop one of them")
    client = read_api_keys(args.api_key_file, env.api_keys)
    admin = read_admin_keys(args.admin_key_file, env.admin_keys)
    check_exposure("strata up", args.host, client, admin, insecure=args.insecure)
    check_not_running(env.run_dir)
    internal = read_internal_keys(args.internal_key_file, env.internal_keys)
    keys = RunKeys.make(env.run_dir, has_internal=bool(internal), has_client=bool(client),
                        has_admin=bool(admin))
    try:
        return _run(args, env, keys)
    finally:
        keys.remove()


def _run(args: argparse.Namespace, env: CliEnv, keys: RunKeys) -> int:
    config = _config(args, env, keys)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    _prefetch(args, env)
    seed = ClusterSeed(seed_version(args), replicas=config.replicas, pools=config.pools)
    asyncio.run(_seed(config.registry_url, seed))
    supervisor = _launcher(args, config)
    stop = {"now": False}

    def request_stop(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    supervisor.start()
    try:
        _wait_ready(supervisor, config, args.ready_timeout_s, lambda: stop["now"])
        if not stop["now"]:
            write_cluster_file(config)
            roles = describe_roles(config.replicas, config.num_prefill)
            announce(f"Strata cluster: {config.replicas} instances{roles} behind "
                     f"http://{config.host}:{config.port} serving {seed.version.key} "
                     f"(logs in {config.log_dir})")
            announce(f"Dashboard: http://{config.host}:{config.port}/dashboard")
        supervisor.run_forever(lambda: stop["now"])
    finally:
        announce("stopping the cluster...")
        cluster_file(config.run_dir).unlink(missing_ok=True)
        supervisor.stop()
    return 0


def seed_version(args: argparse.Namespace) -> ModelVersion:
    """The catalogue entry of the flags' model: NAME is what `strata serve` would call it."""
    version, name = args.model_version or "default", _model_name(args)
    if args.simulate:
        return ModelVersion(name, version, f"sim:{_absolute_if_local(args.simulate)}")
    from strata.model.fetch import DEFAULT_MODEL

    uri = _absolute_if_local(args.model or DEFAULT_MODEL)
    return ModelVersion(name, version, uri, manifest_sha256=local_manifest_sha256(uri))


def _model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return str(args.served_model_name)
    if args.simulate:
        from strata.sim import load_profile

        return load_profile(args.simulate).model
    from strata.model.fetch import DEFAULT_MODEL

    return _served_name(args.model or DEFAULT_MODEL)


def _absolute_if_local(model: str) -> str:
    """A path is stored absolute: the catalogue outlives the directory `strata up` ran in."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def _served_name(model: str) -> str:
    """`strata serve`'s default name, without loading the model: an alias's served name, a GGUF
    file's `general.name`, else the directory's (or URI's) last part."""
    from strata.model.fetch import KNOWN_MODELS

    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model].served_name
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        from strata.model.gguf_file import read_gguf

        return str(read_gguf(path).fields.get("general.name", path.stem))
    return model.rstrip("/").rpartition("/")[2] if "://" in model else path.resolve().name


async def _seed(registry_url: str, seed: ClusterSeed) -> None:
    from strata.registry import create_registry
    from strata.registry.models import create_model_registry

    models, instances = create_model_registry(registry_url), create_registry(registry_url)
    try:
        await seed_registry(models, instances, seed)
    finally:
        await models.close()
        await instances.close()


def _launcher(args: argparse.Namespace, config: LocalClusterConfig) -> Launcher:
    if not args.ray:
        return Supervisor(config)
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--ray needs Ray, which is not installed: pip install 'strata[ray]' "
                          "(`strata doctor` says which optional parts are usable)")
    from strata.cluster.ray_launcher import RayLauncher

    return RayLauncher(up_parallel.ray_config(args, config))


def _config(args: argparse.Namespace, env: CliEnv,
            keys: RunKeys = NO_RUN_KEYS) -> LocalClusterConfig:
    log_flags = _log_flags(args, env)
    serve_args: list[str] = ["--log-level", "warning", *log_flags]
    for flag, _ in _SERVE_FLAGS:
        if flag in VERSION_FLAGS:
            continue  # each instance gets these from its model version
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            serve_args += [flag, str(value)]
    for flag in _SERVE_SWITCHES:  # on, off (--no-...), or the instance's default
        value = getattr(args, flag[2:].replace("-", "_"))
        serve_args += [] if value is None else [flag if value else f"--no-{flag[2:]}"]
    serve_args += _auth_args(args, keys)
    replicas, num_prefill, named = cluster_shape(args)
    threads = up_parallel.rank_threads(args, replicas)  # `strata serve --threads` is per rank
    autoscale = gateway_args(args, _model_name(args), args.simulate) if args.autoscale else []
    gateway = [*(["--policy", args.policy] if args.policy else []),
               *(["--release-consistency", args.release_consistency]
                 if args.release_consistency else []), *autoscale,
               *_auth_args(args, keys), *log_flags, *tracing_args(args), *args.gateway_arg]
    return LocalClusterConfig(
        replicas=replicas, num_prefill=num_prefill, class_pools=named, run_dir=env.run_dir,
        model=args.model,
        host=args.host, port=args.port, serve_args=tuple(serve_args),
        gateway_args=tuple(gateway),
        threads_per_instance=None if args.simulate else threads,
        registry=args.registry or env.registry_url, is_autoscaled=args.autoscale,
    )


def _auth_args(args: argparse.Namespace, keys: RunKeys) -> list[str]:
    """The key flags every child gets (files by absolute path: children may run elsewhere),
    the keys this run made among them."""
    out: list[str] = []
    for flag, path in (("--api-key-file", args.api_key_file),
                       ("--admin-key-file", args.admin_key_file),
                       ("--internal-key-file", args.internal_key_file)):
        if path is not None:
            out += [flag, str(Path(path).resolve())]
    return out + keys.flags() + (["--insecure"] if args.insecure else [])


def _log_flags(args: argparse.Namespace, env: CliEnv) -> list[str]:
    """`--log-format` for the children, unless text is both chosen and their default."""
    chosen = getattr(args, "log_format", None) or env.log_format
    return [] if chosen == env.log_format == "text" else ["--log-format", chosen]


def _prefetch(args: argparse.Namespace, env: CliEnv) -> None:
    """Pull the model once before N instances would all want it."""
    if args.simulate:
        return
    from strata.model.fetch import resolve_model

    resolve_model(args.model, cache_dir=env.cache_dir, progress=True)


def _gateway_routes_all(config: LocalClusterConfig) -> bool:
    """True once the gateway answers and would route to every instance (asked on /ready,
    which needs no API key when the cluster has some)."""
    import httpx

    try:
        if config.replicas == 0:  # an autoscaler starts the first instance on demand
            return httpx.get(f"http://{config.host}:{config.port}/health", timeout=2).is_success
        resp = httpx.get(f"http://{config.host}:{config.port}/ready", timeout=2)
        num_routable = int(resp.json()["num_routable"]) if resp.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return num_routable >= config.replicas


def _wait_ready(supervisor: Launcher, config: LocalClusterConfig, timeout_s: float,
                should_stop: Any) -> None:
    from strata.registry import create_registry
    from strata.registry.instances.records import InstanceState

    async def num_ready() -> int:
        registry = create_registry(config.registry_url)
        try:
            records = await registry.list_instances()
        finally:
            await registry.close()
        return sum(r.state == InstanceState.READY for r in records)

    deadline = time.monotonic() + timeout_s
    while not should_stop():
        supervisor.poll()
        if asyncio.run(num_ready()) >= config.replicas and _gateway_routes_all(config):
            return
        if time.monotonic() > deadline:
            raise StrataError(f"the instances were not ready after {timeout_s:.0f}s; "
                              f"see the logs in {config.log_dir}")
        time.sleep(0.5)
