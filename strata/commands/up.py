"""`strata up`: N instances behind the gateway, where `strata serve` would listen.

Before it starts anything it seeds the registry (strata/cluster/seed.py): the flags' model
becomes NAME@VERSION in the catalogue (NAME: the name `strata serve` would serve it under;
VERSION: --model-version, default "default"), deployed with --replicas instances and live. Once
the cluster is ready it writes {run_dir}/cluster.json (gateway and registry URLs, pid), which
`strata models|release|rollback` read to find the local cluster; stopping removes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from strata.cluster.deployments import VERSION_FLAGS
from strata.cluster.local import LocalClusterConfig, Supervisor
from strata.cluster.seed import ClusterSeed, seed_registry
from strata.commands.argtypes import port_number, positive_float, positive_int
from strata.commands.env import CliEnv
from strata.errors import ConfigError, StrataError
from strata.registry.models import ModelVersion
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
    ("--session-store", str), ("--tensor-parallel-size", positive_int),
    ("--pipeline-parallel-size", positive_int), ("--pipeline-layers", str),
)
_SHORT = {"--tensor-parallel-size": ("-tp",), "--pipeline-parallel-size": ("-pp",)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start N instances behind the gateway on one machine")
    p.add_argument("model", nargs="?", default=None, help="as for `strata serve`")
    p.add_argument("--replicas", type=positive_int, default=2)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000, help="the gateway's port")
    p.add_argument("--policy", default=None, help="gateway routing policy")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="FLAG",
                   help="one more `strata gateway` flag, repeatable "
                        "(e.g. --gateway-arg=--max-in-flight=64)")
    p.add_argument("--threads-per-instance", type=positive_int, default=None,
                   help="torch threads per instance, shared by its ranks (default: cores / "
                        "replicas, at least 1)")
    p.add_argument("--ready-timeout-s", type=positive_float, default=600.0)
    p.add_argument("--log-level", default="info")
    p.add_argument("--registry", default=None,
                   help="registry URL (default: $STRATA_REGISTRY, else SQLite in the run dir; "
                        "Redis for several nodes)")
    p.add_argument("--ray", action="store_true", help="run the instances as Ray actors")
    p.add_argument("--address", default=None, help="Ray cluster address (default: local Ray)")
    p.add_argument("--num-cpus-per-instance", type=positive_float, default=0.5,
                   help="Ray CPUs reserved per instance, shared by its ranks (fractions "
                        "allowed)")
    for flag, kind in _SERVE_FLAGS:
        p.add_argument(flag, *_SHORT.get(flag, ()), type=kind, default=None,
                       help="passed to every instance")


def run(args: argparse.Namespace, env: CliEnv) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = _config(args, env)
    _check_not_running(config.run_dir)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    _prefetch(args, env)
    seed = ClusterSeed(seed_version(args), replicas=args.replicas)
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
            _write_cluster_file(config)
            print(f"Strata cluster: {config.replicas} instances behind "
                  f"http://{config.host}:{config.port} serving {seed.version.key} "
                  f"(logs in {config.log_dir})", flush=True)
            print(f"Dashboard: http://{config.host}:{config.port}/dashboard", flush=True)
        supervisor.run_forever(lambda: stop["now"])
    finally:
        print("stopping the cluster...", flush=True)
        _cluster_file(config.run_dir).unlink(missing_ok=True)
        supervisor.stop()
    return 0


def seed_version(args: argparse.Namespace) -> ModelVersion:
    """The catalogue entry of the flags' model: NAME is what `strata serve` would call it."""
    version = args.model_version or "default"
    if args.simulate:
        from strata.sim import load_profile

        name = args.served_model_name or load_profile(args.simulate).model
        return ModelVersion(name, version, f"sim:{_absolute_if_local(args.simulate)}")
    from strata.model.fetch import DEFAULT_MODEL

    model = args.model or DEFAULT_MODEL
    uri = _absolute_if_local(model)
    name = args.served_model_name or _served_name(model)
    return ModelVersion(name, version, uri, manifest_sha256=local_manifest_sha256(uri))


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
        from gguf import GGUFReader

        field = GGUFReader(path).get_field("general.name")
        return str(field.contents()) if field is not None else path.stem
    return model.rstrip("/").rpartition("/")[2] if "://" in model else path.resolve().name


async def _seed(registry_url: str, seed: ClusterSeed) -> None:
    from strata.registry import create_registry
    from strata.registry.model_registry import create_model_registry

    models, instances = create_model_registry(registry_url), create_registry(registry_url)
    try:
        await seed_registry(models, instances, seed)
    finally:
        await models.close()
        await instances.close()


def _cluster_file(run_dir: Path) -> Path:
    return run_dir / "cluster.json"


def _check_not_running(run_dir: Path) -> None:
    """Two clusters on one run dir would reset each other's registry."""
    try:
        pid = int(json.loads(_cluster_file(run_dir).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # a stale file: that cluster died without removing it
    except PermissionError:
        pass
    raise ConfigError(f"a cluster (pid {pid}) is already running with run dir {run_dir}; stop "
                      "it first, or set STRATA_RUN_DIR to another directory")


def _write_cluster_file(config: LocalClusterConfig) -> None:
    data = {"gateway_url": f"http://{config.host}:{config.port}",
            "registry_url": config.registry_url, "pid": os.getpid()}
    path = _cluster_file(config.run_dir)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # readers never see half a file


def _launcher(args: argparse.Namespace, config: LocalClusterConfig) -> Launcher:
    if not args.ray:
        return Supervisor(config)
    from strata.cluster.ray_launcher import RayClusterConfig, RayLauncher

    return RayLauncher(RayClusterConfig(config, address=args.address,
                                        num_cpus_per_instance=args.num_cpus_per_instance,
                                        tensor_parallel_size=args.tensor_parallel_size or 1,
                                        pipeline_parallel_size=args.pipeline_parallel_size or 1))


def _config(args: argparse.Namespace, env: CliEnv) -> LocalClusterConfig:
    serve_args: list[str] = ["--log-level", "warning"]
    for flag, _ in _SERVE_FLAGS:
        if flag in VERSION_FLAGS:
            continue  # each instance gets these from its model version
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            serve_args += [flag, str(value)]
    ranks = (args.tensor_parallel_size or 1) * (args.pipeline_parallel_size or 1)
    threads = args.threads_per_instance or max(1, (os.cpu_count() or 1) // args.replicas)
    threads = max(1, threads // ranks)  # `strata serve --threads` is per rank
    gateway_args = [*(["--policy", args.policy] if args.policy else []), *args.gateway_arg]
    return LocalClusterConfig(
        replicas=args.replicas, run_dir=env.run_dir, model=args.model, host=args.host,
        port=args.port, serve_args=tuple(serve_args), gateway_args=tuple(gateway_args),
        threads_per_instance=None if args.simulate else threads,
        registry=args.registry or env.registry_url,
    )


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
        resp = httpx.get(f"http://{config.host}:{config.port}/ready", timeout=2)
        num_routable = int(resp.json()["num_routable"]) if resp.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False
    return num_routable >= config.replicas


def _wait_ready(supervisor: Launcher, config: LocalClusterConfig, timeout_s: float,
                should_stop: Any) -> None:
    from strata.registry import create_registry
    from strata.registry.records import InstanceState

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
