"""`strata serve`: one instance: model -> executor -> engine -> async engine -> HTTP app.

With `--registry` the instance registers itself (starting -> ready), heartbeats its load and
deregisters on shutdown; with `--simulate PROFILE` a latency model stands in for the maths.
This module holds the flags and `run`; serve_stack.py composes the instance.
"""

from __future__ import annotations

import argparse
import time

from strata.commands import aio
from strata.commands.argtypes import (
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from strata.commands.env import CliEnv, add_auth_flags
from strata.commands.serve_embed import build_embed_engine
from strata.commands.serve_parallel import add_parallel_flags
from strata.commands.serve_stack import (
    DEFAULT_MAX_MODEL_LEN,
    build_engine,
    build_simulated,
    serve_http,
)
from strata.commands.tracing_flags import add_tracing_flags, start_tracing, tracing_config
from strata.state.urls import schemes_help

DTYPES = ("bfloat16", "float32", "float16")
WEIGHTS_DTYPES = ("auto", "bf16", "q8_0", "q4")  # strata.model.quant_loader says what each means
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model", nargs="?", default=None,
                   help="HF model directory, .gguf file or alias (default: smollm2; with "
                        "--task embed: minilm)")
    p.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help="generate: completions and chat; embed: a sentence encoder (BERT, "
                        "e.g. all-MiniLM-L6-v2) served for /v1/embeddings only")
    p.add_argument("--served-model-name", default=None,
                   help="name clients send as `model` (default: the model's own name)")
    p.add_argument("--model-version", default="default",
                   help="version label; part of every prefix-cache key (default: 'default')")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="one matmul kernel at every batch size, so a request's tokens do not "
                        "depend on its batch, its cached prefix or a resume. Default: on for "
                        "quantized weights (the default model) on an AVX512-BF16 CPU, where a "
                        "busy instance runs the same kernels either way; off for bf16 and "
                        "float32 weights, whose large batches run faster on oneDNN. "
                        "--no-deterministic: the fastest kernel at "
                        "each batch size (one stream 1.3-1.6x faster on an AMX CPU: "
                        "docs/benchmarks.md)")
    p.add_argument("--weights-dtype", choices=WEIGHTS_DTYPES, default="auto",
                   help="auto (default): a GGUF's Q8_0/Q4_0/Q4_1 weights stay quantized on CPU; "
                        "bf16: every weight in --dtype; q8_0, q4: quantize at load")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help=f"context length (default: min(model context, {DEFAULT_MAX_MODEL_LEN}))")
    p.add_argument("--kv-cache-gb", type=positive_float, default=1.0)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-seqs", type=positive_int, default=64)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                   help="token budget per step (default: 512; max-model-len without chunking)")
    p.add_argument("--no-prefix-cache", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--prefill-stretch", type=non_negative_float, default=0.0,
                   help="while decodes run, cap the chunks of a prompt longer than the token "
                        "budget so that a step lasts about this many decode steps (measured; "
                        "e.g. 1.5); 0, the default: no cap")
    p.add_argument("--max-waiting", type=positive_int, default=1024,
                   help="queued requests beyond which new ones get 429")
    p.add_argument("--max-queue-wait-s", type=non_negative_float, default=30.0,
                   help="aging: a request (not sheddable) that has waited this long in the "
                        "engine's queue ranks with the interactive class; 0: no aging")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                   help="auto: the model's sampling defaults (generation_config.json or GGUF "
                        "general.sampling.*) fill fields a request leaves out; none: Strata's")
    p.add_argument("--shutdown-timeout-s", type=non_negative_float, default=30.0,
                   help="on SIGTERM/SIGINT, how long in-flight requests may finish")
    p.add_argument("--keep-alive-s", type=positive_float, default=75.0,
                   help="a client's idle kept-alive connection is closed after this long; keep "
                        "it above the clients' own idle expiry (httpx: 5 s), or a request sent "
                        "as the server closes it gets no answer")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_tracing_flags(p)
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="PEFT LoRA adapters served beside the base model; a request with "
                        "`model: NAME` runs with the adapter at PATH")
    p.add_argument("--max-lora-rank", type=positive_int, default=64,
                   help="adapters of a higher rank are refused (default: 64)")
    p.add_argument("--max-loras", type=positive_int, default=4,
                   help="distinct adapters in one engine step (default: 4)")
    p.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="at most this many adapters resident; the others are known by name and "
                        "path and loaded on demand, evicting the least recently used adapter "
                        "no request holds (default: every adapter stays resident)")
    add_parallel_flags(p)
    _add_cluster_flags(p)


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--registry", default=None, metavar="URL",
                   help=f"register in this registry ({schemes_help('registry')}); "
                        "default $STRATA_REGISTRY; none: do not register")
    p.add_argument("--instance-id", default=None, help="default: HOSTNAME-PORT")
    p.add_argument("--advertise-url", default=None,
                   help="URL routers use to reach this instance (default http://HOST:PORT)")
    p.add_argument("--node", default=None,
                   help="the machine's name in the registry (`strata status` NODE; default: the "
                        "host name; `strata up --ray` passes the Ray node's address)")
    p.add_argument("--role", choices=("mixed", "prefill", "decode"), default="mixed")
    p.add_argument("--pool", default="default")
    p.add_argument("--session-store", default=None, metavar="URL",
                   help=f"keep chat sessions in this store ({schemes_help('sessions')}); "
                        "default: sessions off")
    p.add_argument("--session-ttl-s", type=positive_float, default=86_400.0,
                   help="a session expires this long after its last stored turn")
    p.add_argument("--session-redis-appendfsync", choices=("always", "everysec", "no"),
                   default=None, help="set Redis AOF fsync for the session store (CONFIG SET)")
    p.add_argument("--session-redis-replicas", type=non_negative_int, default=0, metavar="N",
                   help="acknowledge a stored turn only once N Redis replicas hold it (WAIT, "
                        "2 s): with a redis+sentinel:// store, a failover loses no "
                        "acknowledged turn (docs/consistency.md)")
    p.add_argument("--session-consistency", choices=("strong", "session", "eventual"),
                   default="strong",
                   help="strong: a turn is stored before it is acknowledged; session: "
                        "acknowledged from this instance's memory (it reads its own writes) "
                        "and written behind, a turn refused (503) while the oldest unwritten "
                        "one is older than --session-flush-bound-ms; eventual: written behind, "
                        "bounded only by --session-write-queue (docs/consistency.md)")
    p.add_argument("--session-flush-bound-ms", type=positive_float, default=200.0,
                   metavar="MS", help="at --session-consistency session: the most an "
                   "acknowledged turn may wait to be written (what a crash can lose)")
    p.add_argument("--session-write-queue", type=positive_int, default=1024, metavar="N",
                   help="session/eventual: turns that may wait to be written; a full queue "
                        "refuses the turn (503), never drops it")
    _add_kv_flags(p)
    _add_pd_flags(p)
    p.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="answer from a latency model instead of the maths (a profile JSON or a "
                        "bundled name such as smollm2-cpu); labelled simulated everywhere")
    p.add_argument("--sim-start-s", type=non_negative_float, default=0.0,
                   help="with --simulate: take this long from launch to serving, as loading "
                        "a real model would (autoscaling benchmarks use 5)")
    p.add_argument("--s3-endpoint-url", default=None,
                   help="S3-compatible endpoint for s3:// model URIs")
    add_auth_flags(p)


def _add_kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-store", default=None, metavar="URL",
                   help=f"KV block store for --kv-offload ({schemes_help('kv_store')}; "
                        "best a Redis of its own)")
    p.add_argument("--kv-offload", action="store_true",
                   help="publish finished requests' KV blocks to --kv-store and fetch missing "
                        "prefixes from it instead of recomputing them (default off)")
    p.add_argument("--kv-ttl-s", type=positive_float, default=3600.0,
                   help="a published KV block expires this long after it was written")
    p.add_argument("--kv-min-fetch-tokens", type=non_negative_int, default=256,
                   help="prompts shorter than this never fetch (recomputing is cheaper)")
    p.add_argument("--kv-max-put-mb", type=positive_float, default=256.0,
                   help="at most this much KV published per request (leading blocks kept)")
    p.add_argument("--kv-redis-maxmemory-mb", type=positive_int, default=None,
                   help="CONFIG SET maxmemory and maxmemory-policy allkeys-lru on the KV Redis")


def _add_pd_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pd-lease-s", type=positive_float, default=10.0,
                   help="prefill/decode hand-off: how long this instance holds a prompt's blocks "
                        "for a decode instance that has not acknowledged them")
    p.add_argument("--pd-unpulled-s", type=positive_float, default=2.0,
                   help="prefill/decode hand-off: how long the blocks are held when no decode "
                        "instance has begun to pull them (it died, or never got the request)")
    p.add_argument("--pd-shm-mb", type=non_negative_int, default=256,
                   help="prefill/decode hand-off: the shared-memory pool a decode instance on "
                        "this host reads a prompt's blocks from, reserved at the first such pull "
                        "(0: none; decode instances then pull the HTTP stream)")
    p.add_argument("--sim-kv-bandwidth-gbps", type=positive_float, default=0.5,
                   help="with --simulate: the modeled KV transfer rate of a hand-off (GB/s; "
                        "the default is the measured loopback pull rate)")
    p.add_argument("--fault-config", default=None, metavar="FILE",
                   help="tests only: kill points and damaged blocks of the hand-off, a "
                        "parallel rank's failing share (JSON, see strata/server/pd/faults.py)")


def run(args: argparse.Namespace, env: CliEnv) -> int:
    """Load the model, build the engine stack and serve until SIGTERM/SIGINT."""
    started = time.perf_counter()
    start_tracing(tracing_config(args, "strata-instance"))
    if args.task == "embed":
        built = build_embed_engine(args, env)
    else:
        built = build_simulated(args) if args.simulate else build_engine(args, env)
    if args.simulate and args.sim_start_s:  # the model "loads" for the rest of the start time
        time.sleep(max(0.0, args.sim_start_s - (time.perf_counter() - started)))
    return aio.run(serve_http(args, env, built, started))
