"""Simulated instances served by the real app and uvicorn in a thread, on 127.0.0.1: the real
engine, scheduler, detokenizer and HTTP over a `SimulatedExecutor` (tokens are a function of the
seed or prompt and the position, never of the instance)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from server.live_server import serve_in_thread

from strata.server.app import create_app
from strata.server.config import ServerConfig
from strata.sim.profile import LatencyProfile
from strata.sim.server import (
    SimulatedEngineParts,
    build_simulated_async_engine,
    build_simulated_engine,
)
from strata.state.sessions import SessionStore

FAST = LatencyProfile(model="sim", source="synthetic", prefill_ms_base=0.2,
                      prefill_ms_per_token=0.001, decode_ms_base=2.0, decode_ms_per_seq=0.05)


@dataclass
class SimInstance:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_sim_instance(*, model: str = "sim", version: str = "default",
                       profile: LatencyProfile = FAST,
                       session_store: SessionStore | None = None,
                       sleep: Callable[[float], None] = time.sleep,
                       parts: SimulatedEngineParts | None = None) -> SimInstance:
    """One simulated instance (of `parts` when given, an engine built by the test); returns
    once it accepts connections."""
    async_engine, tokenizer = build_simulated_async_engine(parts or build_simulated_engine(
        profile, max_num_seqs=16, kv_blocks=512, max_model_len=1024, sleep=sleep))
    config = ServerConfig(served_model_name=model, model_version=version, simulated=True)
    app = create_app(async_engine, tokenizer, config, session_store=session_store)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server, thread = serve_in_thread(app, sock)
    return SimInstance(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)


__all__ = ["FAST", "SimInstance", "start_sim_instance"]
