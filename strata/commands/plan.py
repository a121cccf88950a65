"""`strata plan`: which architecture does this workload need to meet this SLO?

Simulates every step of the evolution on a virtual clock (strata/plan/) and prints the table,
the cheapest configuration that meets the SLO and what rules out each cheaper one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from strata.commands.argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from strata.commands.env import CliEnv


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict which architecture meets an SLO (simulated)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=positive_float, default=None,
                      help="Poisson arrivals, requests per second")
    load.add_argument("--concurrency", type=positive_int, default=None,
                      help="closed loop: sessions (or requests) at once")
    p.add_argument("--trace", type=Path, default=None,
                   help="a `strata bench --out` report: plan the workload it ran")
    p.add_argument("--num-requests", type=positive_int, default=200, help="turns in all")
    p.add_argument("--prompt-tokens", default="128", help="N or LOW:HIGH (uniform) per turn")
    p.add_argument("--output-tokens", default="64", help="N or LOW:HIGH (uniform)")
    p.add_argument("--prefix-tokens", type=non_negative_int, default=0,
                   help="a shared prefix (system prompt) before each session's first turn")
    p.add_argument("--prefixes", type=positive_int, default=1,
                   help="distinct shared prefixes (tenants), Zipf popularity")
    p.add_argument("--turns", type=positive_int, default=1, help="turns per session")
    p.add_argument("--think-time-s", type=non_negative_float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=positive_float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=positive_float, default=100.0)
    p.add_argument("--slo-percentile", type=positive_float, default=90.0,
                   help="the percentile both bounds hold at")
    p.add_argument("--profile", default="smollm2-cpu",
                   help="latency profile: a `strata profile` JSON file or a bundled name")
    p.add_argument("--max-ranks", type=positive_int, default=64,
                   help="the most ranks (processes / chips) a configuration may use")
    p.add_argument("--steps", default="",
                   help="only these evolution steps, comma separated (e.g. 'one process,"
                        "replicas,sessions')")
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--kv-blocks", type=positive_int, default=4096)
    p.add_argument("--request-overhead-ms", type=non_negative_float, default=2.0)
    p.add_argument("--session-consistency", choices=("strong", "session", "eventual"),
                   default="strong",
                   help="the session store's level (strata serve --session-consistency): "
                        "strong adds --session-write-ms to every turn of a stored session; "
                        "session and eventual write behind the answer")
    # the default is strata.plan.costs.SESSION_WRITE_MS (not imported here: the CLI's start)
    p.add_argument("--session-write-ms", type=non_negative_float, default=13.7,
                   help="one turn's store write (default: bench/session_levels.py, single "
                        "Redis, p50 at strong)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    lora = p.add_argument_group("LoRA adapters (with --adapters, the plan sizes adapter slots "
                                "and k instead; strata/plan/adapters.py)")
    lora.add_argument("--adapters", type=positive_int, default=None,
                      help="LoRA adapters over one base model")
    lora.add_argument("--adapter-zipf", type=non_negative_float, default=1.0,
                      help="their popularity: Zipf exponent (0: all alike)")
    lora.add_argument("--adapter-instances", type=positive_int, default=16)
    lora.add_argument("--adapter-load-s", type=non_negative_float, default=0.1,
                      help="one load: files read and checked, joined to the engine")
    lora.add_argument("--adapter-service-s", type=positive_float, default=1.0,
                      help="a request's time on its instance (with --rate)")
    lora.add_argument("--adapter-max-loads", type=positive_float, default=10.0,
                      help="cold loads per 100 requests the slots must keep under")
    lora.add_argument("--adapter-max-wait-ms", type=positive_float, default=1000.0,
                      help="p99 of a request's wait for its adapter (a load or a slot)")


def run(args: argparse.Namespace, env: CliEnv) -> int:
    from strata.errors import ConfigError
    from strata.plan import Costs, EngineShape, LengthDist, PlanInputs, Slo, Workload, plan
    from strata.plan.report import format_plan, plan_json
    from strata.plan.workload import workload_from_bench_report
    from strata.sim.profile import load_profile

    if args.adapters is not None:
        return _plan_adapters(args)
    measured: dict[str, Any] | None = None
    if args.trace is not None:
        if args.rate is not None or args.concurrency is not None:
            raise ConfigError("--trace sets the load; leave out --rate and --concurrency")
        workload, measured = workload_from_bench_report(args.trace)
    else:
        if args.rate is None and args.concurrency is None:
            raise ConfigError("give the load: --rate REQ_PER_S or --concurrency N "
                              "(or --trace REPORT.json)")
        workload = Workload(
            num_requests=args.num_requests, rate_per_s=args.rate, concurrency=args.concurrency,
            prompt=LengthDist.parse(args.prompt_tokens),
            output=LengthDist.parse(args.output_tokens), prefix_tokens=args.prefix_tokens,
            num_prefixes=args.prefixes, num_turns=args.turns, think_time_s=args.think_time_s,
            seed=args.seed)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_percentile, args.slo_percentile)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    inputs = PlanInputs(workload, slo, load_profile(args.profile), max_ranks=args.max_ranks,
                        steps=steps, shape=EngineShape(max_num_seqs=args.max_num_seqs,
                                                       kv_blocks=args.kv_blocks),
                        costs=Costs(request_overhead_ms=args.request_overhead_ms,
                                    session_consistency=args.session_consistency,
                                    session_write_ms=args.session_write_ms))
    result = plan(inputs)
    if args.json:
        print(json.dumps(plan_json(result, measured=measured), indent=2))
    else:
        print(format_plan(result))
        if measured:
            print(f"measured by the trace: TTFT ms {measured.get('ttft_ms')}, "
                  f"TPOT ms {measured.get('tpot_ms')}")
    return 0


def _plan_adapters(args: argparse.Namespace) -> int:
    """`strata plan --adapters N`: the slots per instance and k per adapter (simulated)."""
    from strata.errors import ConfigError
    from strata.plan.adapters import AdapterWorkload, format_slot_plan, size_slots

    instances = args.adapter_instances
    if args.concurrency is not None:
        in_flight = args.concurrency / instances
    elif args.rate is not None:
        in_flight = args.rate * args.adapter_service_s / instances
    else:
        raise ConfigError("give the load: --rate REQ_PER_S or --concurrency N (in flight over "
                          "the fleet)")
    workload = AdapterWorkload(num_instances=instances, num_adapters=args.adapters,
                               zipf=args.adapter_zipf, load_s=args.adapter_load_s,
                               service_s=args.adapter_service_s,
                               in_flight_per_instance=in_flight, seed=args.seed)
    rows, chosen = size_slots(workload, max_loads_per_100=args.adapter_max_loads,
                              max_wait_p99_ms=args.adapter_max_wait_ms)
    print(format_slot_plan(workload, rows, chosen, args.adapter_max_loads,
                           args.adapter_max_wait_ms))
    return 0
