"""`strata rollback NAME`: undo the model's last release.

A release in progress is rolled back: before its flip, its new instances retire (live never
moved); after it (flipping, retiring), the old version serves again (its instances, or new ones
where they had drained, ready and warmed), live flips back in one atomic write, and the new
version retires. A finished release is undone by releasing the previous version again,
blue-green. Exit 0 once it is back.
"""

from __future__ import annotations

import argparse

from strata.commands.argtypes import positive_float
from strata.commands.control import ControlClient, add_control_flags, release_outcome
from strata.commands.env import CliEnv


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollback", help="roll a model back to its previous version")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--no-wait", action="store_true", help="start the rollback and exit")
    p.add_argument("--timeout-s", type=positive_float, default=1800.0)
    add_control_flags(p)


def run(args: argparse.Namespace, env: CliEnv) -> int:
    client = ControlClient.from_args(args, env)
    try:
        release = client.call("POST", f"/admin/models/{args.name}/rollback")
        print(f"rolling {args.name} back: release {release['release_id']} "
              f"({release['state']}, to {release['to_version']})")
        if args.no_wait:
            return 0
        final = client.follow(release, timeout_s=args.timeout_s)
    finally:
        client.close()
    if final["state"] == "rolled_back" and final["name"] == args.name:
        print(f"{args.name}: the release of {final['to_version']} was rolled back; "
              f"{final['from_version']} is live")
        return 0
    return release_outcome(final)


__all__ = ["add_parser", "run"]
