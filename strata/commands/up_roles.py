"""The prefill/decode side of `strata up`: `--prefill N --decode M` instead of `--replicas`, and
the hand-off flags every instance gets (strata/server/pd_*.py)."""

from __future__ import annotations

import argparse
from typing import Any

from strata.commands.argtypes import non_negative_int, positive_float, positive_int
from strata.errors import ConfigError

PD_SERVE_FLAGS: tuple[tuple[str, Any], ...] = (
    ("--pd-lease-s", positive_float), ("--pd-unpulled-s", positive_float), ("--fault-config", str),
    ("--sim-kv-bandwidth-gbps", positive_float), ("--pd-shm-mb", non_negative_int),
)


def add_role_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=positive_int, default=None, metavar="N",
                   help="a prefill/decode cluster: N prefill instances (with --decode M)")
    p.add_argument("--decode", type=positive_int, default=None, metavar="M",
                   help="... and M decode instances, instead of --replicas (with --autoscale: "
                        "to start with; each pool is then sized on its own)")
    p.add_argument("--pool", action="append", default=[], metavar="NAME=N",
                   help="N more instances in routing pool NAME (`strata serve --pool`), for a "
                        "class routed there: --gateway-arg=--class-pool=interactive=NAME; "
                        "repeatable; with --autoscale, each pool is sized on its own")


def class_pools(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """`--pool fast=1` -> `(("fast", 1),)`."""
    out = []
    for spec in args.pool:
        name, _, count = spec.partition("=")
        if not name or name == "default" or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--pool wants NAME=N (N >= 1, NAME not 'default'), got {spec!r}")
        out.append((name, int(count)))
    return tuple(out)


def initial_replicas(args: argparse.Namespace) -> int:
    """--replicas, else --min-replicas with --autoscale, else 2; 0 only with an autoscaler."""
    replicas = args.replicas if args.replicas is not None else (
        args.min_replicas if args.autoscale else 2)
    if replicas == 0 and not (args.autoscale and args.min_replicas == 0):
        raise ConfigError("--replicas 0 needs --autoscale --min-replicas 0 (an autoscaler to "
                          "start the first instance when a request comes)")
    return int(replicas)


def role_split(args: argparse.Namespace, mixed: int) -> tuple[int, int]:
    """(instances, of which prefill) from --prefill/--decode, else `mixed` (from --replicas)."""
    if args.prefill is None and args.decode is None:
        return mixed, 0
    if args.replicas is not None or args.prefill is None or args.decode is None:
        raise ConfigError("a prefill/decode cluster takes --prefill N and --decode M (both at "
                          "least 1) instead of --replicas")
    return args.prefill + args.decode, args.prefill


def describe_roles(replicas: int, num_prefill: int) -> str:
    """" (1 prefill, 2 decode)" for the announcement; "" for mixed instances."""
    return f" ({num_prefill} prefill, {replicas - num_prefill} decode)" if num_prefill else ""


def cluster_shape(args: argparse.Namespace) -> tuple[int, int, tuple[tuple[str, int], ...]]:
    """(instances, of which prefill, the named pools' sizes, which count among the instances)."""
    replicas, num_prefill = role_split(args, initial_replicas(args))
    named = class_pools(args)
    return replicas + sum(n for _, n in named), num_prefill, named


__all__ = ["PD_SERVE_FLAGS", "add_role_flags", "class_pools", "cluster_shape", "describe_roles",
           "initial_replicas", "role_split"]
