"""The priority-class flags of `strata gateway` (strata/gateway/path/classes.py)."""

from __future__ import annotations

import argparse

from strata.commands.argtypes import non_negative_int
from strata.errors import ConfigError
from strata.gateway.config import ClassConfig
from strata.protocol.priority import CLASS_NAMES


def add_class_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--class-pool", action="append", default=[], metavar="CLASS=POOL",
                   help=f"route a priority class ({', '.join(CLASS_NAMES)}) to the instances "
                        "of a pool (`strata serve --pool`); classes without one use the pools "
                        "no class names; a request spills to another pool only while that "
                        "pool has room for it. Repeatable")
    p.add_argument("--instance-slots", type=non_negative_int, default=0,
                   help="requests one instance takes at once before its pool has no room for "
                        "more of a class (each class counts itself and the classes above); "
                        "with no room, sheddable is refused (429), batch waits up to "
                        "--batch-max-queue, the rest wait by class. 0: no cap")
    p.add_argument("--batch-max-queue", type=non_negative_int, default=128,
                   help="batch requests waiting at the gateway beyond which batch gets 429")
    p.add_argument("--hold-without-instances", action="store_true",
                   help="requests wait (up to --queue-timeout-s) while no instance serves "
                        "their model, e.g. while an autoscaler starts the first one")


def class_config(args: argparse.Namespace) -> ClassConfig:
    pairs = []
    for spec in args.class_pool:
        klass, sep, pool = spec.partition("=")
        if not sep:
            raise ConfigError(f"--class-pool wants CLASS=POOL, got {spec!r}")
        pairs.append((klass.strip().lower(), pool.strip()))
    return ClassConfig(class_pools=tuple(pairs), instance_slots=args.instance_slots,
                       hold_without_instances=args.hold_without_instances)


__all__ = ["add_class_flags", "class_config"]
