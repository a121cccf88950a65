"""`strata release NAME@VERSION`: release a version (blue-green or canary) and follow it.

The gateway's controller starts the new instances through the launcher in use, waits until
every one is ready and warmed by a real request, then flips the model's live pointer in one
atomic write; the old version drains and retires. A canary first takes `--weight` of new
traffic and is rolled back automatically when its error rate or TTFT p99 crosses the limits.
Exit 0 once the release is done; 1 when it rolled back or failed (the reason is printed).
"""

from __future__ import annotations

import argparse

from strata.commands.argtypes import positive_float, positive_int
from strata.commands.control import ControlClient, add_control_flags, release_outcome
from strata.commands.env import CliEnv
from strata.errors import ConfigError
from strata.registry.models import Strategy, split_model_version


def _weight(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"a canary weight is a fraction in (0, 1), got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("release", help="release a model version (blue-green or canary)")
    p.add_argument("model", nargs="?", default=None, metavar="NAME@VERSION")
    p.add_argument("--strategy", choices=[s.value for s in Strategy],
                   default=Strategy.BLUE_GREEN.value)
    p.add_argument("--weight", type=_weight, default=0.1,
                   help="canary: the share of new traffic (and new sessions) it takes")
    p.add_argument("--replicas", type=positive_int, default=None,
                   help="instances of the new version (default: as many as the live one)")
    p.add_argument("--no-wait", action="store_true", help="start it and exit")
    p.add_argument("--timeout-s", type=positive_float, default=1800.0,
                   help="stop following after this long (the release goes on)")
    p.add_argument("--status", default=None, metavar="RELEASE_ID",
                   help="follow an existing release instead of starting one")
    add_control_flags(p)


def run(args: argparse.Namespace, env: CliEnv) -> int:
    client = ControlClient.from_args(args, env)
    try:
        if args.status:
            release = client.call("GET", f"/admin/releases/{args.status}")
        else:
            release = client.call("POST", "/admin/releases", _body(args))
            print(f"release {release['release_id']}: {release['name']}@"
                  f"{release['to_version']} replacing {release['from_version'] or 'nothing'} "
                  f"({release['strategy']}, {release['replicas']} instances) via "
                  f"{client.base_url}")
        if args.no_wait:
            return 0
        return release_outcome(client.follow(release, timeout_s=args.timeout_s))
    finally:
        client.close()


def _body(args: argparse.Namespace) -> dict[str, object]:
    if args.model is None:
        raise ConfigError("name the version to release: strata release NAME@VERSION")
    name, version = split_model_version(args.model)
    if version is None:
        raise ConfigError(f"name the version to release: strata release {name}@VERSION")
    return {"model": f"{name}@{version}", "strategy": args.strategy,
            "canary_weight": args.weight, "replicas": args.replicas}


__all__ = ["add_parser", "run"]
