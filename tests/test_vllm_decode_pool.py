"""The router's pool of vLLM decode instances, probed over real HTTP: an instance whose ``/health`` answers slowly
(a loaded 2-core server at start-up) is still found when a request needs it, and a dead one is not."""

import asyncio
import socket
import time
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from kvxfer.serving.vllm_decode import VLLMDecodePool
from support.http_server import serving


def closed_port() -> str:
    """The address of a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class SlowHealth(BaseHTTPRequestHandler):
    delay = 1.5  # longer than the 1 s probe that once dropped a live decode instance at start-up

    def do_GET(self):
        time.sleep(self.delay)
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_server():
    with serving(SlowHealth) as url:
        yield url


def test_a_slow_but_live_instance_is_found_before_the_first_probe_round(slow_server):
    """Nothing probed yet (the router just started): the first request still finds the live instance."""

    async def main():
        pool = VLLMDecodePool([slow_server])
        async with httpx.AsyncClient() as client:
            assert pool.candidates() == []
            return [i.url for i in await pool.up(client)]

    assert asyncio.run(main()) == [slow_server]


def test_a_dead_instance_is_not_a_candidate_beside_a_live_one(slow_server):
    """One live (slow) and one closed port: only the live one is offered, and saying so takes no timeout."""
    dead = closed_port()

    async def main():
        pool = VLLMDecodePool([dead, slow_server])
        async with httpx.AsyncClient() as client:
            start = time.monotonic()
            up = await pool.up(client)
            return [i.url for i in up], time.monotonic() - start

    urls, took = asyncio.run(main())
    assert urls == [slow_server]
    assert took < 4.0


def test_no_live_instance_is_said_promptly_when_every_port_is_closed():
    async def main():
        pool = VLLMDecodePool([closed_port(), closed_port()])
        async with httpx.AsyncClient() as client:
            start = time.monotonic()
            return await pool.up(client), time.monotonic() - start

    up, took = asyncio.run(main())
    assert up == []
    assert took < 2.0
