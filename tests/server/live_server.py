"""A real Strata server on a free 127.0.0.1 port: uvicorn in a background thread, serving a tiny
random Llama (float32, CPU) through the real Engine and TorchExecutor."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from harness import procs

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.engine.executor import ModelInput, ModelOutput
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel, load_model
from strata.server.app import create_app
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 128


@dataclass
class LiveServer:
    base_url: str
    engine: Engine
    async_engine: AsyncEngine
    config: ServerConfig
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def load_tiny(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, dtype="float32")


def start_server(model: LoadedModel, *, max_waiting: int = 64, max_num_seqs: int = 8,
                 num_blocks: int = 128, wrap: Callable[[Any], Any] | None = None,
                 max_model_len: int = MAX_MODEL_LEN,
                 **server_options: Any) -> LiveServer:
    """Build engine + app and serve them; returns once the socket accepts connections.

    `wrap` wraps the TorchExecutor (tests pace the engine with it)."""
    executor: Any = TorchExecutor(model.config, model.weights, dtype="float32")
    if wrap is not None:
        executor = wrap(executor)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128,
                                max_model_len=max_model_len, max_waiting=max_waiting)
    engine = Engine(executor, CacheConfig(block_size=8, num_blocks=num_blocks), scheduler,
                    model.tokenizer, vocab_size=model.config.vocab_size)
    async_engine = AsyncEngine(engine, max_model_len=max_model_len)
    config = ServerConfig(served_model_name=MODEL_NAME, **server_options)
    app = create_app(async_engine, model.tokenizer, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server, thread = serve_in_thread(app, sock)
    return LiveServer(f"http://127.0.0.1:{port}", engine, async_engine, config, server, thread)


def start_embed_server(model_dir: Path, *, name: str = "tiny-bert", max_num_seqs: int = 8,
                       **server_options: Any) -> LiveServer:
    """An embed instance (`strata serve --task embed`) of the BERT encoder in `model_dir`:
    float32, no prefix cache, whole inputs batched up to 256 tokens a step."""
    import torch

    from strata.model.bert import (
        BertEncoder,
        EncoderExecutor,
        encoder_config,
        encoder_tokenizer,
        load_encoder_weights,
    )
    from strata.server.config import EmbedConfig

    cfg, tokenizer = encoder_config(model_dir), encoder_tokenizer(model_dir)
    encoder = BertEncoder(cfg, load_encoder_weights(model_dir, torch.float32))
    max_len = cfg.max_position_embeddings
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                                max_model_len=max_len, enable_chunked_prefill=False)
    engine = Engine(EncoderExecutor(encoder),
                    CacheConfig(block_size=8, num_blocks=64, enable_prefix_caching=False),
                    scheduler, tokenizer, vocab_size=cfg.vocab_size)
    async_engine = AsyncEngine(engine, max_model_len=max_len)
    embed = EmbedConfig(cfg.hidden_size, cfg.is_matryoshka, cfg.matryoshka_dimensions)
    config = ServerConfig(served_model_name=name, embed=embed, **server_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, thread = serve_in_thread(create_app(async_engine, tokenizer, config), sock)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    return LiveServer(url, engine, async_engine, config, server, thread)


def serve_in_thread(app: Any, sock: socket.socket, **config: Any
                    ) -> tuple[uvicorn.Server, threading.Thread]:
    """Run `app` with uvicorn on `sock` in a daemon thread; returns once it accepts connections."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    return server, thread


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll `predicate()` until true (a correctness wait, not a timing threshold); False if it
    never was within `timeout_s`. The poll is harness.procs.wait_until's."""
    try:
        procs.wait_until(predicate, timeout_s, "a condition", interval_s=0.02)
    except TimeoutError:
        return False
    return True


class GatedExecutor:
    """Wraps an executor; while held, each step waits for a permit (tests pace the engine)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.is_open = True
        self.num_blocked = 0
        self._permits = threading.Semaphore(0)

    def hold(self, allow: int = 0) -> None:
        self._permits = threading.Semaphore(allow)
        self.is_open = False

    def open(self) -> None:
        self.is_open = True
        self._permits.release(1000)

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()  # type: ignore[attr-defined,no-any-return]

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.inner.allocate_kv_cache(num_blocks, block_size)  # type: ignore[attr-defined]

    def execute(self, model_input: ModelInput) -> ModelOutput:
        if not self.is_open:
            self.num_blocked += 1
            self._permits.acquire()
        return self.inner.execute(model_input)  # type: ignore[attr-defined,no-any-return]


class PacedExecutor:
    """Wraps an executor (every other method passes through); each step takes at least `step_s`
    (tests give a request time to be cancelled mid-way) and is counted (`num_steps`)."""

    def __init__(self, inner: object, step_s: float) -> None:
        self.inner = inner
        self.step_s = step_s
        self.num_steps = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, model_input: ModelInput) -> ModelOutput:
        self.num_steps += 1
        time.sleep(self.step_s)
        return self.inner.execute(model_input)  # type: ignore[attr-defined,no-any-return]


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of `base_url`/metrics: `strata:{name}` with `labels` (0 when absent)."""
    text = httpx.get(f"{base_url}/metrics").text
    for line in text.splitlines():
        match = re.match(rf"^strata:{name}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    return 0.0
