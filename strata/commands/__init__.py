"""Subcommands of `strata` beyond serve/models/chat/bench, one module each.

Each module has `add_parser(sub)` and `run(args, env) -> int`; `strata/cli.py` lists them in
`COMMAND_MODULES` and hands them a `CliEnv` (the only place that reads the environment).
"""
