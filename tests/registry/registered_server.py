"""A live tiny server that registers itself: like tests/server/live_server.py, but the socket is
bound first so that the advertised URL is known when the Registration is built."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from live_server import MAX_MODEL_LEN, MODEL_NAME, GatedExecutor, serve_in_thread

from strata.engine.config import CacheConfig, SchedulerConfig
from strata.engine.engine import Engine
from strata.model.executor import TorchExecutor
from strata.model.loader import LoadedModel
from strata.server.app import create_app
from strata.server.async_engine import AsyncEngine
from strata.server.config import ServerConfig
from strata.server.registration import Registration


@dataclass
class RegisteredServer:
    base_url: str
    gate: GatedExecutor
    registration: Registration
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.gate.open()
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_registered(model: LoadedModel,
                     make_registration: Callable[[str, AsyncEngine], Registration]
                     ) -> RegisteredServer:
    """Serve the tiny model (gated executor) with `make_registration(base_url, async_engine)`."""
    gate = GatedExecutor(TorchExecutor(model.config, model.weights, dtype="float32"))
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128,
                                max_model_len=MAX_MODEL_LEN, max_waiting=16)
    engine = Engine(gate, CacheConfig(block_size=8, num_blocks=64), scheduler, model.tokenizer,
                    vocab_size=model.config.vocab_size)
    async_engine = AsyncEngine(engine, max_model_len=MAX_MODEL_LEN)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    registration = make_registration(base_url, async_engine)
    app = create_app(async_engine, model.tokenizer, ServerConfig(served_model_name=MODEL_NAME),
                     registration=registration)
    server, thread = serve_in_thread(app, sock)
    return RegisteredServer(base_url, gate, registration, server, thread)
