"""What `strata serve` composes: model -> executor -> engine -> async engine -> HTTP app -> uvicorn.

`build_engine` loads a model and builds the real stack; `build_simulated` builds the same engine
over a latency model (no torch); `serve_http` binds, registers (with `--registry`) and serves
either until SIGTERM/SIGINT. The flags are in serve.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.commands.env import (
    CliEnv,
    read_admin_keys,
    read_api_keys,
    read_internal_keys,
    read_key_max_priority,
)
from strata.commands.serve_parallel import (
    load_for_serving,
    make_executor,
    openmp_free_main_thread,
    parallel_identity,
    rank_threads,
    serving_device,
    watch_ranks,
)
from strata.errors import ConfigError
from strata.logs import announce
from strata.model.generation_defaults import GenerationDefaults, generation_defaults_of
from strata.protocol.auth import check_exposure

if TYPE_CHECKING:
    from strata.commands.serve_parallel import ParallelModel
    from strata.engine.config import SchedulerConfig
    from strata.model.loader import LoadedModel
    from strata.model.lora import LoraAdapter
    from strata.server.async_engine import AsyncEngine
    from strata.server.config import EmbedConfig, ServerConfig
    from strata.server.lora_routes import LoraLoader
    from strata.server.registration import Registration

DEFAULT_MAX_MODEL_LEN = 2048
ENGINE_DIED_EXIT_STATUS = 3  # the engine could not go on: the launcher restarts the instance
log = logging.getLogger("strata")


@dataclass(frozen=True, slots=True)
class BuiltEngine:
    """What `serve_http` serves: the async engine, its tokenizer and the name clients send."""

    async_engine: AsyncEngine
    tokenizer: Any
    name: str
    simulated: bool = False
    deterministic: bool = False  # one matmul kernel at every batch size (--deterministic)
    generation_defaults: GenerationDefaults = GenerationDefaults()  # --generation-config
    embed: EmbedConfig | None = None  # set: an encoder served for /v1/embeddings (--task embed)
    loras: tuple[tuple[str, str], ...] = ()  # (name, digest) of each adapter resident at start
    lora_paths: tuple[tuple[str, str], ...] = ()  # (name, path) of each --lora-modules adapter
    lora_bytes: tuple[tuple[str, int], ...] = ()  # (digest, bytes) of each resident at start
    lora_loader: LoraLoader | None = None  # POST /v1/load_lora_adapter's (None: refused)


def build_engine(args: argparse.Namespace, env: CliEnv) -> BuiltEngine:
    """Load the model (an alias is pulled) and build the engine stack over it."""
    from strata.model import gemm
    from strata.model.bert import is_encoder_dir
    from strata.model.determinism import (
        deterministic_by_default,
        is_deterministic,
        set_deterministic,
    )
    from strata.model.fetch import DEFAULT_MODEL, KNOWN_MODELS

    path = model_path(args, env)
    if is_encoder_dir(path):
        raise ConfigError(f"{path} is a sentence encoder (BERT): serve it with --task embed")
    log.info("loading %s", path)
    with openmp_free_main_thread(rank_threads(args)):
        loaded, parallel = load_for_serving(args, path, env.cache_dir)
        # before any rank starts (they copy it: RankSpec) and before the first step
        on = args.deterministic
        if on is None:
            on = deterministic_by_default(loaded.weights,
                                          free_attention=_free_attention(args, loaded))
        set_deterministic(on)
        if on:
            log.info("deterministic: one matmul kernel at every batch size (%s)",
                     "AMX tiles" if gemm.has_amx() else "the vector kernel")
        else:
            log.info("deterministic: off, a request's tokens can depend on its batch "
                     "(--deterministic)")
        alias = KNOWN_MODELS.get(args.model or DEFAULT_MODEL)
        name = args.served_model_name or (alias.served_name if alias else loaded.name)
        adapters = load_loras(args, loaded)  # every one checked; the first --max-cpu-loras kept
        resident = adapters[:getattr(args, "max_cpu_loras", None) or len(adapters)]
        async_engine = build_async_engine(args, loaded, name, parallel, resident)
        loaded.weights.clear()  # the executor holds its own (packed) copies
    loader = lora_loader(args, loaded, async_engine)
    defaults = generation_defaults_of(args.generation_config, loaded.generation_defaults,
                                      alias.generation_defaults if alias else None)
    log.info("sampling defaults (--generation-config %s): %s", args.generation_config,
             defaults.as_dict() or "none")
    return BuiltEngine(async_engine, loaded.tokenizer, name, deterministic=is_deterministic(),
                       generation_defaults=defaults,
                       loras=tuple((a.name, a.digest) for a in resident),
                       lora_paths=tuple((a.name, a.path) for a in adapters),
                       lora_bytes=tuple((a.digest, a.num_bytes) for a in resident),
                       lora_loader=loader)


def _free_attention(args: argparse.Namespace, loaded: LoadedModel) -> bool:
    """Whether this instance's decode attention computes a decoded row as a prefill does at
    no cost (`deterministic_by_default`)."""
    from strata.model import cpu_kernels
    from strata.model.loader import torch_dtype_of

    return cpu_kernels.decodes_keys_in_lanes(torch_dtype_of(args.dtype), serving_device(args),
                                             loaded.config.head_dim)


def lora_loader(args: argparse.Namespace, loaded: LoadedModel,
                async_engine: AsyncEngine) -> LoraLoader:
    """Reads an adapter as --lora-modules does, in the executor's dtype and device (so the
    engine thread, which adds it, copies nothing; a parallel executor's device is the CPU,
    whence every rank gets its cut)."""
    from strata.model.lora import load_adapter

    executor = getattr(async_engine.engine, "executor", None)
    dtype, device = getattr(executor, "lora_dtype", None), getattr(executor, "lora_device", None)
    if dtype is None or device is None:
        raise ConfigError("LoRA adapters need the PyTorch executor (one process or parallel)")

    def load(name: str, path: str) -> LoraAdapter:
        return load_adapter(name, path, loaded.config, base_model=str(loaded.source),
                            max_rank=getattr(args, "max_lora_rank", 64), dtype=dtype,
                            device=device)
    return load


def load_loras(args: argparse.Namespace, loaded: LoadedModel) -> list[LoraAdapter]:
    """The --lora-modules NAME=PATH adapters, each checked against the base model."""
    from strata.model.lora import load_adapter

    adapters = []
    for spec in getattr(args, "lora_modules", None) or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if name == (args.served_model_name or loaded.name):
            raise ConfigError(f"--lora-modules: {name!r} is the base model's name")
        adapters.append(load_adapter(name, path, loaded.config, base_model=str(loaded.source),
                                     max_rank=getattr(args, "max_lora_rank", 64)))
    if len({a.name for a in adapters}) != len(adapters):
        raise ConfigError("--lora-modules names an adapter twice")
    return adapters


def build_simulated(args: argparse.Namespace) -> BuiltEngine:
    """The same engine; a latency model instead of the maths (no torch)."""
    from strata.sim import load_profile
    from strata.sim.server import (
        build_simulated_async_engine,
        build_simulated_engine,
        sim_kv_blocks,
    )

    if args.no_chunked_prefill:
        raise ConfigError("--no-chunked-prefill is not supported with --simulate")
    if getattr(args, "deterministic", None):
        raise ConfigError("--deterministic picks the model's kernels; a simulated instance runs "
                          "no model kernels: drop one of them")
    if args.kv_offload:
        raise ConfigError("--kv-offload needs the real model (a simulated instance has no KV "
                          "to publish); drop --kv-offload or --simulate")
    profile = load_profile(args.simulate)
    name = args.served_model_name or profile.model
    async_engine, tokenizer = build_simulated_async_engine(build_simulated_engine(
        profile, max_num_seqs=args.max_num_seqs,
        kv_blocks=sim_kv_blocks(profile, args.kv_cache_gb, args.block_size),
        block_size=args.block_size, max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
        max_num_batched_tokens=args.max_num_batched_tokens or 512,
        enable_prefix_caching=not args.no_prefix_cache, max_waiting=args.max_waiting,
        max_queue_wait_s=args.max_queue_wait_s or None, namespace=f"{name}@{args.model_version}",
        kv_bandwidth_gbps=args.sim_kv_bandwidth_gbps,
    ))
    return BuiltEngine(async_engine, tokenizer, name, simulated=True)


def model_path(args: argparse.Namespace, env: CliEnv, default: str | None = None) -> Path:
    """An alias (`default` when none is given) is pulled; a path, file:// or s3:// URI is
    verified against its manifest."""
    from strata.model.fetch import DEFAULT_MODEL, resolve_model
    from strata.store import is_model_uri, resolve_model_uri

    if args.model is not None and (is_model_uri(args.model) or Path(args.model).exists()):
        return resolve_model_uri(args.model, cache_dir=env.cache_dir,
                                 s3_endpoint_url=args.s3_endpoint_url, progress=True)
    return resolve_model(args.model, cache_dir=env.cache_dir, progress=True,
                         default=default or DEFAULT_MODEL)


def build_async_engine(args: argparse.Namespace, loaded: LoadedModel, name: str,
                       parallel: ParallelModel | None = None,
                       loras: list[LoraAdapter] | None = None) -> AsyncEngine:
    """model -> TorchExecutor (or ParallelExecutor) -> Engine -> AsyncEngine, from the flags."""

    from strata.engine.config import CacheConfig
    from strata.engine.engine import Engine
    from strata.server.async_engine import AsyncEngine

    device = serving_device(args)
    executor = make_executor(args, loaded, parallel, device, name)
    for adapter in loras or []:
        executor.add_lora(adapter)  # a parallel executor hands each rank its cut
    max_model_len = args.max_model_len or min(loaded.config.max_position_embeddings,
                                              DEFAULT_MAX_MODEL_LEN)
    scheduler_config = scheduler_config_from(args, max_model_len)
    cache_config = CacheConfig(
        block_size=args.block_size,
        num_blocks=CacheConfig.blocks_for_gb(args.kv_cache_gb, executor.kv_bytes_per_token(),
                                             args.block_size),
        enable_prefix_caching=not args.no_prefix_cache,
        namespace=f"{name}@{args.model_version}",
    )
    log.info("device %s, dtype %s, %d KV blocks of %d tokens, max_model_len %d", device,
             args.dtype, cache_config.num_blocks, cache_config.block_size, max_model_len)
    engine = Engine(executor, cache_config, scheduler_config, loaded.tokenizer,
                    vocab_size=loaded.config.vocab_size, clock=time.monotonic)
    return AsyncEngine(engine, max_model_len=max_model_len)


def scheduler_config_from(args: argparse.Namespace, max_model_len: int) -> SchedulerConfig:
    from strata.engine.config import SchedulerConfig

    chunked = not args.no_chunked_prefill
    budget = args.max_num_batched_tokens or (512 if chunked else max(512, max_model_len))
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, enable_chunked_prefill=chunked, max_waiting=args.max_waiting,
        max_queue_wait_s=args.max_queue_wait_s or None,
        prefill_stretch=args.prefill_stretch,
        max_loras=getattr(args, "max_loras", None),
    )


async def serve_http(args: argparse.Namespace, env: CliEnv, built: BuiltEngine,
                     started: float) -> int:
    """Bind, register (if asked), serve; SIGTERM/SIGINT drain in-flight requests, exit 0
    (1 when a parallel instance lost a rank)."""
    import uvicorn

    from strata.server.app import create_app
    from strata.server.config import ServerConfig

    name, simulated = built.name, built.simulated
    api_keys = read_api_keys(args.api_key_file, env.api_keys)
    admin_keys = read_admin_keys(args.admin_key_file, env.admin_keys)
    check_exposure("strata serve", args.host, api_keys, admin_keys, insecure=args.insecure)
    sock = _bind(args.host, args.port)
    port = sock.getsockname()[1]
    server_config = ServerConfig(served_model_name=name, host=args.host, port=port,
                                 shutdown_timeout_s=args.shutdown_timeout_s,
                                 api_keys=api_keys, admin_keys=admin_keys,
                                 internal_keys=read_internal_keys(args.internal_key_file,
                                                                  env.internal_keys),
                                 key_max_priority=read_key_max_priority(args.api_key_file, env),
                                 rate_limit_per_s=args.rate_limit_per_s, simulated=simulated,
                                 deterministic=built.deterministic,
                                 model_version=args.model_version,
                                 session_store_url=args.session_store,
                                 session_ttl_s=args.session_ttl_s,
                                 session_redis_appendfsync=args.session_redis_appendfsync,
                                 session_redis_replicas=args.session_redis_replicas,
                                 session_consistency=args.session_consistency,
                                 session_flush_bound_s=args.session_flush_bound_ms / 1000,
                                 session_write_queue=args.session_write_queue,
                                 generation_defaults=built.generation_defaults, pd=_pd_config(args),
                                 embed=built.embed, loras=dict(built.loras),
                                 lora_paths=dict(built.lora_paths),
                                 max_cpu_loras=getattr(args, "max_cpu_loras", None),
                                 **_kv_options(args))
    registration = _registration(args, env, built.async_engine, server_config)
    app = create_app(built.async_engine, built.tokenizer, server_config,
                     registration=registration, lora_loader=built.lora_loader,
                     lora_bytes=dict(built.lora_bytes))
    server = _server_draining_first(uvicorn.Config(
        app, log_level=args.log_level, access_log=args.log_level == "debug",
        log_config=None,  # its loggers go through strata/logs.py's handler
        timeout_graceful_shutdown=args.shutdown_timeout_s,
        timeout_keep_alive=math.ceil(args.keep_alive_s),
    ), app.state.instance.begin_drain)
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; these handlers
    # absorb it so that a requested stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    exit_status = exit_when_engine_dies(server, built.async_engine)
    announce = asyncio.create_task(_announce_when_started(server, args.host, port, name, started))
    watch_ranks(app, built.async_engine)
    await server.serve(sockets=[sock])  # the lifespan shutdown drains, deregisters, stops
    announce.cancel()
    return exit_status()


def _server_draining_first(config: Any, begin_drain: Callable[[], None]) -> Any:
    """A uvicorn server that calls `begin_drain` (DRAINING in the registry) when asked to stop,
    before it waits for open connections: no router takes a stopping instance for a READY one."""
    import uvicorn

    class DrainFirst(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            begin_drain()
            await super().shutdown(sockets)

    return DrainFirst(config)


def exit_when_engine_dies(server: Any, async_engine: AsyncEngine) -> Callable[[], int]:
    """Once the engine dies (it failed every stream with "error"), stop serving as a SIGTERM
    would; the returned function gives the exit status: 0, or ENGINE_DIED_EXIT_STATUS."""
    loop = asyncio.get_running_loop()
    died: list[str] = []

    def stop(reason: str) -> None:
        log.error("the engine died (%s); stopping, exit status %d, so that the launcher "
                  "restarts this instance", reason, ENGINE_DIED_EXIT_STATUS)
        server.should_exit = True

    def on_death(reason: str) -> None:  # on the engine thread
        died.append(reason)
        loop.call_soon_threadsafe(stop, reason)

    async_engine.on_death(on_death)
    return lambda: ENGINE_DIED_EXIT_STATUS if died else 0


def _pd_config(args: argparse.Namespace) -> Any:
    from strata.server.pd.config import PDConfig
    from strata.server.pd.faults import FaultConfig

    faults = FaultConfig.load(Path(args.fault_config)) if args.fault_config else FaultConfig()
    return PDConfig(lease_s=args.pd_lease_s, unpulled_s=args.pd_unpulled_s,
                    shm_mb=args.pd_shm_mb, faults=faults)


def _kv_options(args: argparse.Namespace) -> dict[str, Any]:
    maxmemory_mb = args.kv_redis_maxmemory_mb
    return {"kv_offload": args.kv_offload, "kv_store_url": args.kv_store,
            "kv_ttl_s": args.kv_ttl_s, "kv_min_fetch_tokens": args.kv_min_fetch_tokens,
            "kv_max_put_bytes": int(args.kv_max_put_mb * (1 << 20)),
            "kv_redis_maxmemory_bytes": maxmemory_mb << 20 if maxmemory_mb else None}


def _bind(host: str, port: int) -> socket.socket:
    """Bind before serving so that `--port 0` yields a known URL to advertise.

    IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose protocol is TCP; with
    protocol 0, Nagle stays on and a proxied stream's first chunk waits ~40 ms for a delayed ACK."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _registration(args: argparse.Namespace, env: CliEnv, async_engine: AsyncEngine,
                  config: ServerConfig) -> Registration | None:
    """The instance's record carries what its GET /v1/models card says: its name, whether it is
    simulated, whether it is deterministic."""
    registry_url = args.registry or env.registry_url
    if not registry_url or registry_url == "none":
        return None
    from strata.server.registration import build_registration

    return build_registration(
        registry_url, instance_id=args.instance_id or f"{socket.gethostname()}-{config.port}",
        advertise_url=args.advertise_url or f"http://{args.host}:{config.port}",
        model=config.served_model_name, async_engine=async_engine, version=args.model_version,
        role=args.role, pool=args.pool, simulated=config.simulated,
        deterministic=config.deterministic, **parallel_identity(async_engine),
        node=args.node or args.ray_node_ip or socket.gethostname(),
    )


async def _announce_when_started(server: Any, host: str, port: int, name: str,
                                 started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    ready_s = time.perf_counter() - started
    announce(f"Strata serving {name} on http://{host}:{port} (ready in {ready_s:.1f}s)")
