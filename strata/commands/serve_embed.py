"""`strata serve --task embed`: a sentence encoder -> EncoderExecutor -> engine -> async engine.

The model is a BERT encoder: the alias `minilm` (all-MiniLM-L6-v2, pulled from PyPI, the
default) or an HF directory of one. Every request is a pooling request (strata/engine/request.py):
the scheduler batches whole inputs (no chunking: an encoder attends both ways), no prefix cache
(no KV is kept), and its KV blocks are bookkeeping only. The encoder runs in float32: it is small,
and the embeddings then match the sentence-transformers reference to ~1e-7.
"""

from __future__ import annotations

import argparse
import logging
import time

from strata.commands.env import CliEnv
from strata.commands.serve_parallel import serving_device
from strata.commands.serve_stack import BuiltEngine, model_path
from strata.engine.config import CacheConfig, SchedulerConfig
from strata.errors import ConfigError

DEFAULT_MAX_BATCHED_TOKENS = 4096  # an encoder step: many short inputs, or a few long ones
log = logging.getLogger("strata")


def build_embed_engine(args: argparse.Namespace, env: CliEnv) -> BuiltEngine:
    """Load the encoder (an alias is pulled) and build the engine stack over it."""
    import torch

    from strata.engine.engine import Engine
    from strata.model.bert import (
        BertEncoder,
        EncoderExecutor,
        encoder_config,
        encoder_tokenizer,
        load_encoder_weights,
    )
    from strata.model.fetch import DEFAULT_EMBED_MODEL, KNOWN_MODELS
    from strata.server.async_engine import AsyncEngine
    from strata.server.config import EmbedConfig

    if args.simulate or args.kv_offload or args.role != "mixed" or args.deterministic:
        raise ConfigError("--task embed serves the encoder itself: drop --simulate, "
                          "--kv-offload, --role and --deterministic")
    path = model_path(args, env, default=DEFAULT_EMBED_MODEL)
    log.info("loading encoder %s", path)
    if args.threads:
        torch.set_num_threads(args.threads)
    config, tokenizer = encoder_config(path), encoder_tokenizer(path)
    device = serving_device(args)
    encoder = BertEncoder(config, load_encoder_weights(path, torch.float32), device=device)
    max_len = min(args.max_model_len or config.max_position_embeddings,
                  config.max_position_embeddings)
    cache_config, scheduler_config = engine_configs(args, max_len)
    engine = Engine(EncoderExecutor(encoder), cache_config, scheduler_config, tokenizer,
                    vocab_size=config.vocab_size, clock=time.monotonic)
    alias = KNOWN_MODELS.get(args.model or DEFAULT_EMBED_MODEL)
    name = args.served_model_name or (alias.served_name if alias else path.resolve().name)
    log.info("encoder on %s: %d dimensions, %s pooling, max input %d tokens", device,
             config.hidden_size, config.pooling, max_len)
    embed = EmbedConfig(config.hidden_size, config.is_matryoshka, config.matryoshka_dimensions)
    return BuiltEngine(AsyncEngine(engine, max_model_len=max_len), tokenizer, name, embed=embed)


def engine_configs(args: argparse.Namespace, max_len: int) -> tuple[CacheConfig, SchedulerConfig]:
    """The encoder engine's cache and scheduler configs: whole inputs, no prefix cache, and
    blocks enough for every sequence slot at full length (they hold no memory)."""
    budget = max(args.max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS, max_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
        enable_chunked_prefill=False, max_waiting=args.max_waiting,
        max_queue_wait_s=args.max_queue_wait_s or None)
    num_blocks = args.max_num_seqs * (-(-(max_len + 1) // args.block_size))
    cache_config = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                               enable_prefix_caching=False,
                               namespace=f"embed@{args.model_version}")
    return cache_config, scheduler_config

