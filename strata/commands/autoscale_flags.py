"""The autoscaler's flags: `strata gateway --autoscale ...` runs it inside the gateway, and
`strata up --autoscale ...` passes them to its gateway (strata/autoscale/)."""

from __future__ import annotations

import argparse
from typing import Any

from strata.commands.argtypes import non_negative_float, non_negative_int, positive_float
from strata.errors import ConfigError

# flag, type, default, help: shared by `strata gateway` and `strata up`
_FLAGS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--min-replicas", non_negative_int, 1,
     "fewest instances (0: none while idle; requests wait at the gateway while the first "
     "starts)"),
    ("--max-replicas", non_negative_int, 8, "most instances"),
    ("--ttft-slo-s", positive_float, 2.0, "time to first token p95 to keep"),
    ("--itl-slo-s", positive_float, 0.1,
     "inter-token latency to keep: caps the batch the capacity model counts on"),
    ("--target-utilization", positive_float, 0.9,
     "scale up when the modelled load passes this share of the fleet"),
    ("--down-utilization", positive_float, 0.8,
     "scale down only when one instance fewer would run under this share"),
    ("--scale-interval-s", positive_float, 0.5, "how often the autoscaler decides"),
    ("--scale-up-dwell-s", non_negative_float, 2.0,
     "least time between two scale-ups (a load step or a growing queue: none)"),
    ("--scale-down-dwell-s", non_negative_float, 30.0,
     "how long one instance fewer must have kept headroom, and least time between downs"),
    ("--scale-down-after-up-s", non_negative_float, 60.0, "least time from an up to a down"),
    ("--autoscale-window-s", positive_float, 30.0, "the arrival rate's window"),
    ("--autoscale-prompt-tokens", positive_float, 200.0,
     "the requests' typical prompt length, for the capacity model"),
    ("--autoscale-output-tokens", positive_float, 100.0,
     "their typical output length (the measured correction absorbs a different mix)"),
)


def add_autoscale_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--autoscale", action="store_true",
                   help="size the model's live deployment to the load (this gateway leads "
                        "while it holds the registry's lease; the launcher starts and drains "
                        "instances)")
    p.add_argument("--autoscale-model", default=None, metavar="NAME",
                   help="the model to size (strata up: its model)")
    p.add_argument("--autoscale-profile", default="smollm2-cpu", metavar="PROFILE",
                   help="the instances' fitted latency profile (a JSON file or a bundled "
                        "name; make one with `strata profile`)")
    p.add_argument("--autoscale-max-num-seqs", type=non_negative_int, default=64,
                   help="the instances' --max-num-seqs")
    for flag, kind, default, text in _FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--class-slo", action="append", default=[], metavar="CLASS=TTFT_S:ITL_S",
                   help="a priority class's own targets (TTFT and ITL p95, seconds): the pool "
                        "it lives in (--class-pool) is sized to the strictest targets of its "
                        "classes, e.g. interactive=0.5:0.05. Repeatable")
    p.add_argument("--pool-replicas", action="append", default=[], metavar="POOL=MIN:MAX",
                   help="other bounds for one pool (prefill, decode, a class pool's name), "
                        "repeatable; the others take --min-replicas and --max-replicas")


def pool_bounds(specs: list[str]) -> tuple[tuple[str, int, int], ...]:
    """`["prefill=1:4"]` -> `(("prefill", 1, 4),)`."""
    out = []
    for spec in specs:
        label, _, bounds = spec.partition("=")
        low, _, high = bounds.partition(":")
        if not label or not low.isdigit() or not high.isdigit():
            raise ConfigError(f"--pool-replicas wants POOL=MIN:MAX (e.g. prefill=1:4), "
                              f"got {spec!r}")
        out.append((label, int(low), int(high)))
    return tuple(out)


def class_slos(specs: list[str]) -> tuple[tuple[str, float, float], ...]:
    """`["interactive=0.5:0.05"]` -> `(("interactive", 0.5, 0.05),)`."""
    from strata.protocol.priority import CLASS_NAMES

    out = []
    for spec in specs:
        klass, _, targets = spec.partition("=")
        ttft, _, itl = targets.partition(":")
        try:
            ttft_s, itl_s = float(ttft), float(itl)
        except ValueError:
            raise ConfigError(f"--class-slo wants CLASS=TTFT_S:ITL_S (e.g. "
                              f"interactive=0.5:0.05), got {spec!r}") from None
        if klass.strip().lower() not in CLASS_NAMES:
            raise ConfigError(f"--class-slo {spec!r}: the class is one of "
                              f"{', '.join(CLASS_NAMES)}")
        out.append((klass.strip().lower(), ttft_s, itl_s))
    return tuple(out)


def autoscale_config(args: argparse.Namespace) -> Any:
    from strata.autoscale.config import AutoscaleConfig

    return AutoscaleConfig(
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        interval_s=args.scale_interval_s, target_utilization=args.target_utilization,
        down_utilization=args.down_utilization, ttft_slo_s=args.ttft_slo_s,
        itl_slo_s=args.itl_slo_s, prompt_tokens=round(args.autoscale_prompt_tokens),
        output_tokens=round(args.autoscale_output_tokens),
        max_num_seqs=args.autoscale_max_num_seqs, up_dwell_s=args.scale_up_dwell_s,
        down_dwell_s=args.scale_down_dwell_s, down_after_up_s=args.scale_down_after_up_s,
        window_s=args.autoscale_window_s, pool_bounds=pool_bounds(args.pool_replicas),
        class_slos=class_slos(getattr(args, "class_slo", [])),
        class_pools=tuple((k.strip().lower(), p.strip()) for k, _, p in
                          (spec.partition("=") for spec in getattr(args, "class_pool", []))))


def build_autoscaler(args: argparse.Namespace, models: Any, owner: str) -> Any:
    """The gateway's autoscaler (a `strata.gateway.app.Companion`), or None without
    --autoscale."""
    if not args.autoscale:
        return None
    if models is None:
        raise ConfigError("--autoscale needs --registry (it writes the deployments there)")
    if not args.autoscale_model:
        raise ConfigError("--autoscale needs --autoscale-model NAME (the model to size)")
    from strata.autoscale.capacity import CapacityModel
    from strata.autoscale.controller import Autoscaler
    from strata.autoscale.gateway_link import GatewayAutoscaler
    from strata.autoscale.law import ScalingLaw
    from strata.sim import load_profile

    config = autoscale_config(args)
    model = CapacityModel(load_profile(args.autoscale_profile), config.max_num_seqs,
                          config.itl_slo_s)
    return GatewayAutoscaler(Autoscaler(ScalingLaw(config, model), models,
                                        model=args.autoscale_model, owner=owner))


def gateway_args(args: argparse.Namespace, model: str, profile: str | None) -> list[str]:
    """`strata up`: the gateway flags that run the autoscaler over the cluster's model."""
    if not args.autoscale:
        return []
    out = ["--autoscale", "--autoscale-model", model,
           "--instance-slots", str(args.max_num_seqs or 64),
           "--autoscale-max-num-seqs", str(args.max_num_seqs or 64)]
    if profile:
        out += ["--autoscale-profile", profile]
    if args.min_replicas == 0:
        out.append("--hold-without-instances")
    for flag, _, _, _ in _FLAGS:
        out += [flag, str(getattr(args, flag.lstrip("-").replace("-", "_")))]
    for spec in args.pool_replicas:
        out += ["--pool-replicas", spec]
    for spec in args.class_slo:
        out += ["--class-slo", spec]
    return out


__all__ = ["add_autoscale_flags", "autoscale_config", "build_autoscaler", "class_slos",
           "gateway_args", "pool_bounds"]
