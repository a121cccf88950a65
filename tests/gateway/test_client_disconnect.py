"""A client that hangs up mid-stream stops the stream through the gateway: the gateway closes
its upstream answer (the instance sees its client go and stops generating), and gives back the
instance's in-flight count and the admission slot. Real sockets: the instance and the gateway
are uvicorn servers on 127.0.0.1, the client a plain socket that closes after the first frame."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator

from gateway_fakes import FixedSource
from live_fleet import serve_app
from live_server import wait_until
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from strata.gateway.app import create_gateway_app
from strata.gateway.config import GatewayConfig
from strata.gateway.routing.instances import InstanceView
from strata.gateway.wiring import Gateway


def endless_instance(stopped: threading.Event) -> Starlette:
    """Streams one frame, then nothing until its client goes (it notes that it stopped)."""

    async def completions(request: Request) -> StreamingResponse:
        async def frames() -> AsyncIterator[bytes]:
            try:
                yield b'data: {"first": true}\n\n'
                while True:
                    await asyncio.sleep(0.01)
            finally:
                stopped.set()

        return StreamingResponse(frames(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_a_client_that_hangs_up_mid_stream_stops_the_instance_and_frees_its_slot() -> None:
    stopped = threading.Event()
    instance = serve_app(endless_instance(stopped))
    app = create_gateway_app(GatewayConfig(policy="round_robin"),
                             FixedSource(InstanceView("a", instance.url, "m")),
                             run_background=False)
    gateway = serve_app(app)
    state: Gateway = app.state.gateway
    try:
        body = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
        port = int(gateway.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n"
                           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
                           % len(body) + body)
            received = b""
            while b'"first"' not in received:
                received += client.recv(4096)
            view = state.source.instances.get("a")
            assert view is not None and view.num_in_flight == 1
            assert state.admission.num_in_flight == 1
        assert wait_until(stopped.is_set), "the instance kept streaming to a gone client"
        assert wait_until(lambda: view.num_in_flight == 0 and state.admission.num_in_flight == 0)
    finally:
        gateway.stop()
        instance.stop()
