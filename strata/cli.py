"""`strata`: the command line and the only composition root.

This is the one module that reads environment variables and the one that wires layers together:
model -> executor -> engine -> async engine -> HTTP app -> uvicorn. Heavy imports (torch, the
model, the server) happen inside the subcommands so that `strata --help` and the clients start
fast.

Environment: STRATA_CACHE_DIR (default `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`) holds
pulled models and dequantized weights; STRATA_RUN_DIR (default `$STRATA_CACHE_DIR/run`) what
`strata up` keeps; STRATA_API_KEYS (comma separated) the accepted API keys; STRATA_REGISTRY the
default registry URL.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata.commands.argtypes import (
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from strata.commands.env import CliEnv
from strata.errors import StrataError

if TYPE_CHECKING:
    from strata.model.loader import LoadedModel
    from strata.server.async_engine import AsyncEngine

DEFAULT_URL = "http://127.0.0.1:8000"
DTYPES = ("bfloat16", "float32", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_MAX_MODEL_LEN = 2048
log = logging.getLogger("strata")
COMMAND_MODULES: tuple[str, ...] = ()  # modules of strata.commands, each a subcommand


def cache_dir_from_env(env: Mapping[str, str]) -> Path:
    """STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    if env.get("STRATA_CACHE_DIR"):
        return Path(env["STRATA_CACHE_DIR"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "strata"
    return Path.home() / ".cache" / "strata"


def cli_env_from(env: Mapping[str, str]) -> CliEnv:
    cache_dir = cache_dir_from_env(env)
    run_dir = Path(env["STRATA_RUN_DIR"]).expanduser() if env.get("STRATA_RUN_DIR") else None
    keys = tuple(k.strip() for k in env.get("STRATA_API_KEYS", "").split(",") if k.strip())
    return CliEnv(cache_dir=cache_dir, run_dir=run_dir or cache_dir / "run", api_keys=keys,
                  registry_url=env.get("STRATA_REGISTRY") or None)


def _command_modules() -> list[Any]:
    import importlib

    return [importlib.import_module(f"strata.commands.{name}") for name in COMMAND_MODULES]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .gguf file or alias (default: smollm2)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: the model's own name)")
    p.add_argument("--model-version", default=None,
                   help="version label; part of every prefix-cache key (default: 'default')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help=f"context length (default: min(model context, {DEFAULT_MAX_MODEL_LEN}))")
    p.add_argument("--kv-cache-gb", type=positive_float, default=1.0)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget per step (default: 512; max-model-len without chunking)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--max-waiting", type=positive_int, default=1024,
                   help="queued requests beyond which new ones get 429")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--shutdown-timeout-s", type=non_negative_float, default=30.0,
                   help="on SIGTERM/SIGINT, how long in-flight requests may finish")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="pull or list known models")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="{pull,list}")
    pull = msub.add_parser("pull", help="download a known model into the cache")
    pull.add_argument("name", nargs="?", default=None, help="alias (default: smollm2)")
    msub.add_parser("list", help="known aliases and whether they are cached")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running server in the terminal")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=non_negative_float, default=None)
    p.add_argument("--max-tokens", type=positive_int, default=None)
    p.add_argument("--once", default=None, metavar="PROMPT",
                   help="send one prompt, print the answer and exit")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from strata.bench.workloads import WORKLOADS

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed")
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--input-len", type=positive_int, default=128,
                   help="prompt tokens (multi-turn: words per user turn)")
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--prefix-len", type=non_negative_int, default=1000,
                   help="shared-prefix tokens")
    p.add_argument("--sessions", type=positive_int, default=8, help="multi-turn sessions")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per session")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_int, default=8)
    load.add_argument("--request-rate", type=positive_float, default=None,
                      help="Poisson arrivals per second (instead of --concurrency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=positive_float, default=600.0,
                   help="bound on the whole run")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    """The `strata` argument parser with its four subcommands."""
    from strata import __version__

    parser = argparse.ArgumentParser(prog="strata", description="Strata LLM serving.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    names = ["serve", "models", "chat", "bench", *COMMAND_MODULES]
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(names) + "}")
    for add in (_add_serve, _add_models, _add_chat, _add_bench):
        add(sub)
    for module in _command_modules():
        module.add_parser(sub)
    return parser


def cmd_models_list(cache_dir: Path) -> int:
    from strata.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, cached_model_path

    print(f"{'ALIAS':<12}{'SERVED NAME':<26}{'STATUS':<12}PATH")
    for name, spec in sorted(KNOWN_MODELS.items()):
        path = cached_model_path(spec, cache_dir)
        status = "cached" if path.exists() else "not cached"
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name:<12}{spec.served_name:<26}{status:<12}{path}{default}")
    return 0


def cmd_models_pull(name: str | None, cache_dir: Path) -> int:
    from strata.model.fetch import DEFAULT_MODEL, pull_model

    path = pull_model(name or DEFAULT_MODEL, cache_dir=cache_dir, progress=True)
    print(path)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from strata.clients.chat import ChatOptions, run_chat

    options = ChatOptions(url=args.url, model=args.model, system=args.system,
                          temperature=args.temperature, max_tokens=args.max_tokens)
    return run_chat(options, once=args.once)


def cmd_bench(args: argparse.Namespace) -> int:
    from strata.bench.loadgen import BenchConfig, run_benchmark
    from strata.bench.report import format_table, write_json

    config = BenchConfig(
        url=args.url, model=args.model, workload=args.workload, num_requests=args.num_requests,
        input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
        num_sessions=args.sessions, num_turns=args.turns, concurrency=args.concurrency,
        request_rate=args.request_rate, seed=args.seed, timeout_s=args.timeout_s,
        show_progress=not args.no_progress,
    )
    report = asyncio.run(run_benchmark(config))
    print(format_table(report))
    if args.out is not None:
        write_json(report, args.out)
        print(f"wrote {args.out}")
    return 0 if report["num_completed"] else 1


def cmd_serve(args: argparse.Namespace, cache_dir: Path) -> int:
    """Load the model, build the engine stack and serve until SIGTERM/SIGINT."""
    started = time.perf_counter()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from strata.model.fetch import DEFAULT_MODEL, KNOWN_MODELS, resolve_model
    from strata.model.loader import load_model

    path = resolve_model(args.model, cache_dir=cache_dir, progress=True)
    log.info("loading %s", path)
    loaded = load_model(path, dtype=args.dtype, cache_dir=cache_dir)
    alias = KNOWN_MODELS.get(args.model or DEFAULT_MODEL)
    name = args.served_model_name or (alias.served_name if alias else loaded.name)
    async_engine = build_async_engine(args, loaded, name)
    return asyncio.run(_serve_http(args, async_engine, loaded, name, started))


def build_async_engine(args: argparse.Namespace, loaded: LoadedModel, name: str) -> AsyncEngine:
    """model -> TorchExecutor -> Engine -> AsyncEngine, configured from the flags."""
    import torch

    from strata.engine.config import CacheConfig, SchedulerConfig
    from strata.engine.engine import Engine
    from strata.model.executor import TorchExecutor
    from strata.server.async_engine import AsyncEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    executor = TorchExecutor(loaded.config, loaded.weights, dtype=args.dtype, device=device)
    max_model_len = args.max_model_len or min(loaded.config.max_position_embeddings,
                                              DEFAULT_MAX_MODEL_LEN)
    chunked = not args.no_chunked_prefill
    budget = args.max_num_batched_tokens or (512 if chunked else max(512, max_model_len))
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget,
        max_model_len=max_model_len, enable_chunked_prefill=chunked, max_waiting=args.max_waiting,
    )
    cache_config = CacheConfig(
        block_size=args.block_size,
        num_blocks=CacheConfig.blocks_for_gb(args.kv_cache_gb, executor.kv_bytes_per_token(),
                                             args.block_size),
        enable_prefix_caching=not args.no_prefix_cache,
        namespace=f"{name}@{args.model_version or 'default'}",
    )
    log.info("device %s, dtype %s, %d KV blocks of %d tokens, max_model_len %d", device,
             args.dtype, cache_config.num_blocks, cache_config.block_size, max_model_len)
    engine = Engine(executor, cache_config, scheduler_config, loaded.tokenizer,
                    vocab_size=loaded.config.vocab_size)
    return AsyncEngine(engine, max_model_len=max_model_len)


async def _serve_http(args: argparse.Namespace, async_engine: AsyncEngine, loaded: LoadedModel,
                      name: str, started: float) -> int:
    import uvicorn

    from strata.server.app import create_app
    from strata.server.config import ServerConfig

    server_config = ServerConfig(served_model_name=name, host=args.host, port=args.port,
                                 shutdown_timeout_s=args.shutdown_timeout_s)
    app = create_app(async_engine, loaded.tokenizer, server_config)
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        access_log=args.log_level == "debug", timeout_graceful_shutdown=args.shutdown_timeout_s,
    ))
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; these handlers
    # absorb it so that a requested stop exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    announce = asyncio.create_task(_announce_when_started(server, args, name, started))
    await server.serve()  # the app's lifespan shutdown drains and stops the engine
    announce.cancel()
    return 0


async def _announce_when_started(server: Any, args: argparse.Namespace, name: str,
                                 started: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    ready_s = time.perf_counter() - started
    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
    print(f"Strata serving {name} on http://{args.host}:{port} (ready in {ready_s:.1f}s)",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `strata` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    env = cli_env_from(os.environ)
    cache_dir = env.cache_dir
    try:
        if args.command in COMMAND_MODULES:
            module = _command_modules()[COMMAND_MODULES.index(args.command)]
            return int(module.run(args, env))
        if args.command == "serve":
            return cmd_serve(args, cache_dir)
        if args.command == "models":
            if args.models_command == "pull":
                return cmd_models_pull(args.name, cache_dir)
            return cmd_models_list(cache_dir)
        if args.command == "chat":
            return cmd_chat(args)
        return cmd_bench(args)
    except StrataError as e:
        print(f"strata {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
