"""The router's upstream connections: never reused once idle for as long as the servers keep them (uvicorn, and so
vLLM and the decode endpoint, close an idle connection after 5 s; a request sent on one that very moment dies with
a bare ReadError). A real HTTP/1.1 server that keeps connections open counts the connections the router opens."""

import asyncio
import http.server
from typing import ClassVar

import pytest

from kvxfer.serving.router import KEEPALIVE, DecodePool, Router
from support.http_server import serving


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps each connection open for the next request
    connections: ClassVar[list[int]] = []

    def setup(self):
        super().setup()
        self.connections.append(self.client_address[1])

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _KeepAlive.connections = []
    with serving(_KeepAlive) as url:
        yield url


def test_an_upstream_connection_idle_past_the_keepalive_is_not_reused(server):
    assert KEEPALIVE < 5.0  # uvicorn's timeout_keep_alive, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE

    async def go():
        router = Router(server, None, DecodePool([]))
        try:
            for pause in (0.0, 0.1, KEEPALIVE + 0.5):
                await asyncio.sleep(pause)
                r = await router.client.get(f"{server}/x")
                assert r.status_code == 200 and r.text == "ok"
        finally:
            await router.client.aclose()

    asyncio.run(go())
    # the first two share one connection (so the server does keep them); the third, after the pause, opened its own
    assert len(_KeepAlive.connections) == 2, _KeepAlive.connections
