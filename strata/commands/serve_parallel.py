"""`strata serve --tensor-parallel-size T --pipeline-parallel-size P`: one model over T x P ranks.

The serving process is rank 0; `--distributed-executor mp` (the default) spawns the others on
this host, `ray` makes them Ray actors in one placement group (strata/cluster/ray_ranks.py:
the group `--ray-placement-group` names, as `strata up --ray` passes, or one of its own). The
weights never pass through this process: it
prepares the model (config, tokenizer; a GGUF is converted into the cache) and every rank reads
its own slices. `--threads` is per rank (default: this host's cores / ranks, at least 1).

A rank that dies is fatal: the engine stops (streams in flight end with an error, other
requests get 503), the instance deregisters and `strata serve` exits 3, so that its launcher
(the local supervisor, Ray) restarts the whole instance.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.commands.argtypes import positive_int
from strata.errors import ConfigError

if TYPE_CHECKING:
    from strata.model.loader import LoadedModel
    from strata.model.parallel.executor import ParallelExecutor
    from strata.model.parallel.layout import ParallelLayout
    from strata.model.parallel.shard_loader import PreparedModel
    from strata.server.async_engine import AsyncEngine

EXECUTORS = ("mp", "ray")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                   help="split every layer over this many ranks (default 1)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                   help="split the layers into this many stages of ranks (default 1)")
    p.add_argument("--pipeline-layers", default=None, metavar="N,N,...",
                   help="layers per pipeline stage (default: as even as they go)")
    p.add_argument("--distributed-executor", choices=EXECUTORS, default="mp",
                   help="how the ranks other than 0 start: mp (local processes, default) or ray")
    p.add_argument("--ray-address", default=None,
                   help="with --distributed-executor ray: the Ray cluster to join (e.g. auto, "
                        "HOST:6379; default: start a local Ray on the loopback)")
    p.add_argument("--ray-node-ip", default=None, metavar="IP",
                   help="with --ray-address: the address of the Ray node this process runs "
                        "on (strata up --ray passes it; default: Ray's pick, the head when it "
                        "runs here)")
    p.add_argument("--ray-placement-group", default=None, metavar="HEX_ID",
                   help="with --distributed-executor ray: place rank i in bundle i of this "
                        "group (strata up --ray makes one per replica; default: make one)")
    p.add_argument("--ray-cpus-per-rank", type=float, default=None,
                   help="with --distributed-executor ray: CPUs each rank reserves (fractions "
                        "allowed; default: the cluster's CPUs shared out, at most 1)")


def parallel_layout(args: argparse.Namespace) -> ParallelLayout | None:
    """The layout the flags ask for; None for one process (T = P = 1)."""
    from strata.model.parallel.layout import ParallelLayout, parse_pipeline_layers

    layers = parse_pipeline_layers(args.pipeline_layers) if args.pipeline_layers else None
    layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size, layers)
    if layout.world_size == 1:
        return None
    if args.simulate:
        raise ConfigError("--simulate has no ranks: drop --tensor/--pipeline-parallel-size")
    ray_flags = [args.ray_address, args.ray_node_ip, args.ray_placement_group,
                 args.ray_cpus_per_rank]
    if args.distributed_executor != "ray" and any(f is not None for f in ray_flags):
        raise ConfigError("--ray-address, --ray-node-ip, --ray-placement-group and "
                          "--ray-cpus-per-rank need "
                          "--distributed-executor ray")
    return layout


def rank_threads(args: argparse.Namespace) -> int | None:
    """Torch threads of each rank: --threads, else the cores shared out (parallel only)."""
    layout = parallel_layout(args)
    if args.threads or layout is None:
        return int(args.threads) if args.threads else None
    return max(1, (os.cpu_count() or 1) // layout.world_size)


@dataclass
class ParallelModel:
    """What `load_for_serving` gives a parallel instance instead of the weights."""

    prepared: PreparedModel
    layout: ParallelLayout


def load_for_serving(args: argparse.Namespace, path: Path,
                     cache_dir: Path) -> tuple[LoadedModel, ParallelModel | None]:
    """The model as one process serves it (with weights), or without weights when the flags
    ask for ranks (they read their own slices)."""
    from strata.model.generation_defaults import read_generation_defaults
    from strata.model.loader import LoadedModel, load_model

    layout = parallel_layout(args)
    if layout is None:
        return load_model(path, dtype=args.dtype, cache_dir=cache_dir,
                          weights_dtype=args.weights_dtype, device=serving_device(args)), None
    if args.weights_dtype not in ("auto", "bf16"):
        raise ConfigError(f"--weights-dtype {args.weights_dtype} runs in one process only; "
                          "tensor and pipeline ranks read bf16 weights (--weights-dtype bf16)")
    from strata.model.parallel.shard_loader import prepare_model

    prepared = prepare_model(path, dtype=args.dtype, cache_dir=cache_dir,
                             uri=_store_name(args.model), s3_endpoint_url=args.s3_endpoint_url)
    layout.validate(prepared.config)
    loaded = LoadedModel(prepared.config, {}, prepared.tokenizer, prepared.name, prepared.source,
                         read_generation_defaults(prepared.source))
    return loaded, ParallelModel(prepared, layout)


def _store_name(model: str | None) -> str:
    """What ranks on other nodes resolve: the URI or alias as given; "" for a local path (its
    absolute form then, which every node must mount)."""
    from strata.model.fetch import DEFAULT_MODEL
    from strata.store import is_model_uri

    name = model or DEFAULT_MODEL
    return name if is_model_uri(name) or not Path(name).exists() else ""


def serving_device(args: argparse.Namespace) -> str:
    """`--device`, else cuda where torch sees a GPU, else cpu."""
    import torch

    return str(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def make_executor(args: argparse.Namespace, loaded: LoadedModel, parallel: ParallelModel | None,
                  device: str, name: str) -> Any:
    """A TorchExecutor, or a ParallelExecutor over the ranks (stopped at exit)."""
    if parallel is None:
        from strata.model.executor import TorchExecutor

        return TorchExecutor(loaded.config, loaded.weights, dtype=args.dtype, device=device,
                             model_name=name, model_version=args.model_version)
    from strata.model.parallel.executor import ParallelExecutor

    executor = ParallelExecutor(parallel.prepared, parallel.layout, dtype=args.dtype,
                                device=device, threads=rank_threads(args) or 1,
                                model_name=name, model_version=args.model_version,
                                launcher=_launcher(args), faults=_share_faults(args))
    atexit.register(executor.shutdown)
    return executor


def _share_faults(args: argparse.Namespace) -> tuple[Any, ...]:
    """Tests only: the `share_fault` of `--fault-config` (strata/server/pd/faults.py)."""
    if not getattr(args, "fault_config", None):
        return ()
    from strata.model.parallel.share import ShareFault
    from strata.server.pd.faults import FaultConfig

    spec = FaultConfig.load(Path(args.fault_config)).share_fault
    if spec is None:
        return ()
    if spec.get("prompt_run") and spec["rank"] != 0:
        raise ConfigError("fault config: a share_fault's prompt_run arms on rank 0 only (the "
                          "other ranks get a step's rows without the prompts)")
    return (ShareFault(**{**spec, "prompt_run": tuple(spec.get("prompt_run", ()))}),)


def _launcher(args: argparse.Namespace) -> Any:
    """None (the executor's default: local processes) or Ray's."""
    if args.distributed_executor != "ray":
        return None
    from strata.cluster.ray_ranks import RayPlacement, RayRankLauncher

    cuda = serving_device(args).startswith("cuda")
    return RayRankLauncher(RayPlacement(address=args.ray_address, node_ip=args.ray_node_ip,
                                        placement_group=args.ray_placement_group,
                                        cpus_per_rank=args.ray_cpus_per_rank,
                                        gpus_per_rank=1.0 if cuda else 0.0))


def _parallel_executor(async_engine: AsyncEngine) -> ParallelExecutor | None:
    """The engine's executor when it is a ParallelExecutor. None exists unless its module was
    imported (by build_executor): a simulated or one-process engine does not import torch for
    this check, seconds of a simulated instance's start."""
    module = sys.modules.get("strata.model.parallel.executor")
    executor = getattr(async_engine.engine, "executor", None)
    if module is None or not isinstance(executor, module.ParallelExecutor):
        return None
    return executor


def parallel_identity(async_engine: AsyncEngine) -> dict[str, Any]:
    """What the registry shows of a parallel instance: its layout and its ranks (host, pid,
    weight and KV bytes); nothing for one process."""
    from strata.registry.instances.records import RankInfo

    executor = _parallel_executor(async_engine)
    if executor is None:
        return {}
    ranks = tuple(RankInfo(m.rank, m.host, m.pid, m.weight_bytes, m.kv_bytes)
                  for m in executor.rank_memory())
    return {"layout": executor.layout.name, "ranks": ranks}


def watch_ranks(app: Any, async_engine: AsyncEngine) -> None:
    """With a parallel executor: per-rank memory on /metrics; a rank's exit (even while idle)
    kills the engine, whose death stops the HTTP server like any engine death
    (serve_stack.exit_when_engine_dies: after the streams in flight got their error)."""
    executor = _parallel_executor(async_engine)
    if executor is None:
        return
    app.state.instance.metrics.watch_ranks(
        lambda: [(m.rank, m.weight_bytes, m.kv_bytes) for m in executor.rank_memory()],
        pipeline=executor.pipeline_stats)
    executor.on_failure = async_engine.kill


@contextmanager
def openmp_free_main_thread(threads: int | None) -> Iterator[None]:
    """Load and build on one thread; afterwards torch uses `threads` (default: its own).

    The engine steps on its own thread. libgomp gives every thread that starts a parallel region
    a team of its own, and once a process holds more OpenMP threads than CPUs it stops spinning
    between regions: a futex wake per region, +60 us each, which made every decode step behind
    the HTTP server ~25 % slower than offline. Built on one thread, the main thread never gets
    a team, so the engine thread's is the only one. `torch.set_num_threads` is a process-wide
    setting that each thread applies at its first parallel op, so the engine thread sees the
    value restored here.
    """
    import torch

    threads = threads or torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
