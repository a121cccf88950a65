"""`strata`: the command line and the only composition root.

This is the one module that reads environment variables and the one that wires layers together:
model -> executor -> engine -> async engine -> HTTP app -> uvicorn (`strata.commands.serve`),
gateways and launchers (`strata.commands.*`). Heavy imports (torch, the
model, the server) happen inside the subcommands so that `strata --help` and the clients start
fast.

Environment: STRATA_CACHE_DIR (default `$XDG_CACHE_HOME/strata`, else `~/.cache/strata`) holds
pulled models, dequantized weights and built C kernels (STRATA_KERNEL_CACHE_DIR moves the
kernels alone); STRATA_RUN_DIR (default `$STRATA_CACHE_DIR/run`) what
`strata up` keeps; STRATA_API_KEYS (comma separated) the accepted API keys; STRATA_ADMIN_KEYS
(comma separated) the admin keys (for /admin/*); STRATA_INTERNAL_KEYS (comma separated) the
fleet's internal keys (strata/protocol/keys.py); STRATA_REGISTRY the default registry URL;
STRATA_LOG_FORMAT (`text` or `json`) the log format of a command run without `--log-format`.
Logging is configured here, once per process (strata/logs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from strata.cache_dirs import cache_dir_from_env, kernel_cache_dir
from strata.commands.argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from strata.commands.env import CliEnv
from strata.errors import StrataError
from strata.logs import LOG_FORMATS, LogConfig, configured
from strata.model import kernel_build
from strata.protocol.budgets import key_limits
from strata.protocol.priority import key_ceilings

DEFAULT_URL = "http://127.0.0.1:8000"
log = logging.getLogger("strata")
# modules of strata.commands, one subcommand each (add_parser + run)
COMMAND_MODULES: tuple[str, ...] = (
    "serve", "gateway", "up", "status", "sessions", "store", "profile", "models", "release",
    "rollback", "doctor", "plan",
)
COMMAND_NAMES: tuple[str, ...] = ("chat", "bench", *COMMAND_MODULES)


def cli_env_from(env: Mapping[str, str]) -> CliEnv:
    cache_dir = cache_dir_from_env(env)
    run_dir = Path(env["STRATA_RUN_DIR"]).expanduser() if env.get("STRATA_RUN_DIR") else None
    specs, limits = key_limits(_keys(env, "STRATA_API_KEYS"))
    keys, ceilings = key_ceilings(specs)
    return CliEnv(cache_dir=cache_dir, run_dir=run_dir or cache_dir / "run", api_keys=keys,
                  key_max_priority=tuple(sorted(ceilings.items())),
                  key_limits=tuple(sorted(limits.items())),
                  admin_keys=_keys(env, "STRATA_ADMIN_KEYS"),
                  internal_keys=_keys(env, "STRATA_INTERNAL_KEYS"),
                  registry_url=env.get("STRATA_REGISTRY") or None,
                  log_format=env.get("STRATA_LOG_FORMAT") or "text")


def _keys(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in env.get(name, "").split(",") if k.strip())


def _command_module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"strata.commands.{name}")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running server in the terminal")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default=None)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=non_negative_float, default=None)
    p.add_argument("--max-tokens", type=positive_int, default=None)
    p.add_argument("--once", default=None, metavar="PROMPT",
                   help="send one prompt, print the answer and exit")
    p.add_argument("--session", default=None, metavar="ID",
                   help="continue the server-side session ID (history kept by the server)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from strata.bench.workloads import WORKLOADS

    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="default 32; with --check-determinism: the prompts checked, default 12")
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
    p.add_argument("--api-key", default=None,
                   help="sent as Authorization: Bearer KEY (default: $STRATA_API_KEYS' first)")
    p.add_argument("--check-determinism", action="store_true",
                   help="instead of a load: send the same prompts alone, again with their "
                        "prefix cached, and inside a concurrent batch, greedy and seeded, and "
                        "report how many answers are identical (exit 1 if any is not)")
    p.add_argument("--batch-size", type=positive_int, default=36,
                   help="with --check-determinism: the concurrent batch the prompts join")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `strata` argument parser with its subcommands; with `only` (a command's name), that
    command's alone: a process started as `strata serve ...` does not import the modules of the
    other commands (half a second of CPU at every start of an instance or a gateway)."""
    from strata import __version__

    parser = argparse.ArgumentParser(prog="strata", description="Strata LLM serving.")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(COMMAND_NAMES) + "}")
    for add in (_add_chat, _add_bench):
        if only in (None, add.__name__.removeprefix("_add_")):
            add(sub)
    for name in COMMAND_MODULES:
        if only in (None, name):
            _command_module(name).add_parser(sub)
    for command in _leaf_parsers(parser):
        command.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                             help="text (default) or json: one JSON object per log line "
                                  "(default $STRATA_LOG_FORMAT)")
    return parser


def _leaf_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of the commands that run (`strata models pull`, not `strata models`): a flag
    defined on both a parser and its subcommand would be reset by the subcommand's default."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for action in subs for child in dict.fromkeys(action.choices.values())
            for leaf in _leaf_parsers(child)]


def log_config_from(args: argparse.Namespace, env: CliEnv) -> LogConfig:
    """The flag, else STRATA_LOG_FORMAT, else text; the command's --log-level, else info.
    `args.log_format` is set to the outcome, which `strata up` hands to its children."""
    args.log_format = args.log_format or env.log_format
    return LogConfig(format=args.log_format, level=str(getattr(args, "log_level", "info")))


def cmd_chat(args: argparse.Namespace, env: CliEnv) -> int:
    from strata.clients.chat import ChatOptions, run_chat

    api_key = args.api_key or (env.api_keys[0] if env.api_keys else None)
    options = ChatOptions(url=args.url, model=args.model, system=args.system,
                          temperature=args.temperature, max_tokens=args.max_tokens,
                          session_id=args.session, api_key=api_key)
    return run_chat(options, once=args.once)


def cmd_bench(args: argparse.Namespace, env: CliEnv) -> int:
    from strata.bench.loadgen import BenchConfig, run_benchmark
    from strata.bench.report import format_table

    api_key = args.api_key or (env.api_keys[0] if env.api_keys else None)
    if args.check_determinism:
        return cmd_check_determinism(args, api_key)
    config = BenchConfig(
        url=args.url, model=args.model, workload=args.workload, api_key=api_key,
        num_requests=args.num_requests or 32,
        input_len=args.input_len, output_len=args.output_len, prefix_len=args.prefix_len,
        num_sessions=args.sessions, num_turns=args.turns, concurrency=args.concurrency,
        request_rate=args.request_rate, seed=args.seed, timeout_s=args.timeout_s,
        show_progress=not args.no_progress,
    )
    report = asyncio.run(run_benchmark(config))
    _print_report(format_table(report), report, args.out)
    return 0 if report["num_completed"] else 1


def _print_report(table: str, report: dict[str, object], out: Path | None) -> None:
    """A bench report on stdout, and as JSON at `out` when given."""
    from strata.bench.report import write_json

    print(table)
    if out is not None:
        write_json(report, out)
        print(f"wrote {out}")


def cmd_check_determinism(args: argparse.Namespace, api_key: str | None) -> int:
    from strata.bench.determinism import (
        DeterminismConfig,
        check_determinism,
        format_determinism,
    )
    config = DeterminismConfig(
        url=args.url, model=args.model, api_key=api_key, num_prompts=args.num_requests or 12,
        output_len=args.output_len, batch_size=args.batch_size, seed=args.seed,
        timeout_s=args.timeout_s, show_progress=not args.no_progress)
    report = asyncio.run(check_determinism(config))
    _print_report(format_determinism(report), report, args.out)
    return 0 if report["all_identical"] else 1


def _run(args: argparse.Namespace, env: CliEnv) -> int:
    if args.command in COMMAND_MODULES:
        return int(_command_module(args.command).run(args, env))
    if args.command == "chat":
        return cmd_chat(args, env)
    return cmd_bench(args, env)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `strata` console script; returns the exit code."""
    given = sys.argv[1:] if argv is None else argv
    only = given[0] if given and given[0] in COMMAND_NAMES else None
    args = build_parser(only).parse_args(given)
    env = cli_env_from(os.environ)
    kernel_build.use_cache_dir(kernel_cache_dir(os.environ))
    try:
        log_config = log_config_from(args, env)
    except StrataError as e:
        print(f"strata {args.command}: error: {e}", file=sys.stderr)
        return 1
    with configured(log_config):
        try:
            return _run(args, env)
        except StrataError as e:
            if log_config.is_json:  # every line a JSON object, this one too
                log.error("strata %s: error: %s", args.command, e)
            else:
                print(f"strata {args.command}: error: {e}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
