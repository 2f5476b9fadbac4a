"""The reference decode endpoint (``kvxfer-decode``, a real process) with a real kvxfer producer in another
process, no vLLM: its bearer token, and /v1/generate answering at once when the KV will not come."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from conformance.kvspec import Spec
from conformance.peers import ProducerProcess as Sender

from .conftest import start_decode

TOKEN = "decode-secret-7f3a"
# the endpoint's cache as the producer sees it: [num_blocks, kv_heads, block_size, 2*head_dim] per layer, bf16
SPEC = Spec(kind="hnd", num_blocks=8, layers=2, heads=2, block_size=128, head_dim=32, dtype="bfloat16", lib="torch")
AUTH = {"authorization": f"Bearer {TOKEN}"}
BAD = [
    {},
    {"authorization": "Bearer wrong-token"},
    {"authorization": f"Basic {TOKEN}"},
    {"authorization": f"Bearer {TOKEN}x"},
    {"authorization": TOKEN},
]


@pytest.fixture
def endpoint(logs, request):
    procs = []

    def start(*extra: str, token: str | None = TOKEN) -> str:
        env = {"KVXFER_DECODE_TOKEN": token} if token else None
        p, url = start_decode(
            logs, f"decode-{request.node.name}-{len(procs)}", "--num-blocks", str(SPEC.num_blocks), *extra, env=env
        )
        procs.append(p)
        return url

    yield start
    for p in procs:
        p.kill(signal.SIGTERM)
        assert p.p.returncode == -signal.SIGTERM, p.tail()  # uvicorn shuts down, then re-raises the signal


@pytest.fixture
def sender():
    s = Sender(SPEC, "tcp", seed=3)
    yield s
    s.close()


def info(url: str) -> dict:
    r = httpx.get(f"{url}/info", headers=AUTH, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def generate(url: str, req: str, headers: dict, **extra) -> httpx.Response:
    body = {"req": req, "first_token": 7, "max_tokens": 4, "stream": False, "timeout": 10, **extra}
    return httpx.post(f"{url}/v1/generate", json=body, headers=headers, timeout=30)


def test_without_the_token_nobody_claims_the_output(endpoint, sender):
    url = endpoint()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # liveness stays open
    for headers in BAD:
        assert httpx.get(f"{url}/info", headers=headers, timeout=5).status_code == 401
        assert httpx.get(f"{url}/metrics", headers=headers, timeout=5).status_code == 401
        assert httpx.post(f"{url}/v1/reserve", json={"tokens": 10}, headers=headers, timeout=5).status_code == 401
    address = info(url)["kvxfer"]
    assert sender.push(address, "victim", [1, 2], meta={"num_tokens": 200})["status"] == "done"
    for headers in BAD:
        r = generate(url, "victim", headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error" and "tokens" not in r.text
        assert r.headers["www-authenticate"] == "Bearer"
    assert info(url)["handed"] == 1 and info(url)["generated"] == 0  # still there, unclaimed
    r = generate(url, "victim", AUTH)
    assert r.status_code == 200, r.text
    assert len(r.json()["token_ids"]) == 4 and r.json()["kv"]["blocks"] == 2
    assert info(url)["handed"] == 0 and info(url)["generated"] == 4


def test_without_a_token_configured_the_api_is_open(endpoint, sender):
    url = endpoint(token=None)
    address = httpx.get(f"{url}/info", timeout=5).json()["kvxfer"]
    assert sender.push(address, "open", [3], meta={"num_tokens": 100})["status"] == "done"
    assert generate(url, "open", {}).status_code == 200


def test_a_request_nobody_sends_fails_after_its_admit_timeout(endpoint):
    url = endpoint()
    start = time.monotonic()
    r = generate(url, "never-sent", AUTH, timeout=30, admit_timeout=0.5)
    elapsed = time.monotonic() - start
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert 0.5 <= elapsed < 2.0, elapsed


def test_a_refused_admission_fails_after_its_admit_timeout(endpoint, sender):
    url = endpoint("--max-inflight", "1")
    address = info(url)["kvxfer"]
    sender.call("hold")  # the first push is admitted and then moves nothing: the endpoint is full
    sender.push(address, "first", [1], meta={"num_tokens": 100}, wait=False)
    sender.push(address, "refused", [2], meta={"num_tokens": 100}, wait=False, retry_busy=True)  # Busy, again and again
    start = time.monotonic()
    r = generate(url, "refused", AUTH, timeout=30, admit_timeout=0.5)
    assert r.status_code == 504, r.text
    assert time.monotonic() - start < 2.0
    assert info(url)["rejected"] > 0
    sender.call("go")


def test_a_transfer_that_fails_after_admission_fails_the_generate_at_once(endpoint):
    url = endpoint()
    address = info(url)["kvxfer"]
    doomed = Sender(SPEC, "tcp", seed=4)
    try:
        doomed.call("hold")
        doomed.push(address, "doomed", [1, 2, 3], meta={"num_tokens": 300}, wait=False)
        with httpx.Client(timeout=30) as client:
            answer = {}
            waiter = threading.Thread(
                target=lambda: answer.update(
                    r=client.post(
                        f"{url}/v1/generate",
                        headers=AUTH,
                        json={
                            "req": "doomed",
                            "first_token": 1,
                            "max_tokens": 2,
                            "stream": False,
                            "timeout": 30,
                            "admit_timeout": 5,
                        },
                    )
                )
            )
            waiter.start()
            deadline = time.monotonic() + 10
            while info(url)["inflight"] != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert info(url)["inflight"] == 1  # admitted, receiving
            killed = time.monotonic()
            doomed.kill()
            waiter.join(30)
        assert answer["r"].status_code == 502, answer["r"].text
        assert answer["r"].json()["error"]["code"] == "peer"
        assert time.monotonic() - killed < 2.0
    finally:
        doomed.close()
