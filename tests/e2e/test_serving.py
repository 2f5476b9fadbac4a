"""The whole disaggregated path on CPU with real processes: router -> vLLM prefill (KVXferConnector ships
the KV) -> reference decode endpoint (receives, checks digests, streams) -> client."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .conftest import start_decode, start_router

pytestmark = pytest.mark.e2e
LOW = {"x-kvxfer-route": "low-latency"}


def prompt(words: int, offset: int = 3) -> str:
    return " ".join(f"w{offset + i % 400}" for i in range(words))


def info(url: str) -> dict:
    return httpx.get(f"{url}/info", timeout=5).json()


def sse(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def wait_until(predicate, timeout: float = 15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


@pytest.fixture(scope="module")
def pool(logs):
    procs, urls = [], []
    for name in ("decode-a", "decode-b"):
        p, u = start_decode(logs, name, "--num-blocks", "32")
        procs.append(p)
        urls.append(u)
    yield urls
    for p in procs:
        p.kill()


@pytest.fixture(scope="module")
def router(vllm_server, pool, logs):
    args = [a for u in pool for a in ("--decode", u)]
    proc, url = start_router(logs, "router", vllm_server, *args)
    wait_until(lambda: len(httpx.get(f"{url}/health").json()["decode_endpoints"]) == 2)
    yield url
    proc.kill()


def _totals(urls):
    infos = [info(u) for u in urls]
    return {k: sum(i[k] for i in infos) for k in ("completed", "failed", "verified", "handed")}


def test_low_latency_completion_ships_kv_and_decodes(router, pool):
    before = _totals(pool)
    r = httpx.post(f"{router}/v1/completions", headers=LOW, timeout=120,
                   json={"model": "tiny", "prompt": prompt(40), "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"][0]["text"].split()) == 8
    assert body["choices"][0]["finish_reason"] == "length"
    assert "kvxfer" in (body.get("kv_transfer_params") or {})
    after = _totals(pool)
    assert after["completed"] == before["completed"] + 1 and after["verified"] == before["verified"] + 1
    assert after["failed"] == before["failed"]
    wait_until(lambda: _totals(pool)["handed"] == 0)  # blocks released after the stream


def test_low_latency_streaming_chat(router, pool):
    before = _totals(pool)
    with httpx.stream("POST", f"{router}/v1/chat/completions", headers=LOW, timeout=120,
                      json={"model": "tiny", "messages": [{"role": "user", "content": prompt(30, 50)}],
                            "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("error" in c for c in chunks), chunks
    assert len(chunks) == 6 and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _totals(pool)["verified"] == before["verified"] + 1


def test_plain_request_bypasses_kvxfer(router, pool):
    before = _totals(pool)
    r = httpx.post(f"{router}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": prompt(20), "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"].startswith("vllm") and not body.get("kv_transfer_params")
    assert _totals(pool)["completed"] == before["completed"]


def test_prefill_error_reaches_the_client(router):
    r = httpx.post(f"{router}/v1/completions", headers=LOW, timeout=120,
                   json={"model": "tiny", "prompt": prompt(1500), "max_tokens": 4})
    assert r.status_code == 400 and "error" in r.json()


def test_busy_endpoint_is_skipped_then_all_busy_is_429(vllm_server, logs):
    small, small_url = start_decode(logs, "decode-small", "--num-blocks", "2")
    big, big_url = start_decode(logs, "decode-big", "--num-blocks", "32")
    proc, url = start_router(logs, "router-busy", vllm_server, "--decode", small_url, "--decode", big_url)
    try:
        wait_until(lambda: len(httpx.get(f"{url}/health").json()["decode_endpoints"]) == 2)
        r = httpx.post(f"{url}/v1/completions", headers=LOW, timeout=120,
                       json={"model": "tiny", "prompt": prompt(300), "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert info(small_url)["completed"] == 0 and info(big_url)["completed"] == 1
        big.kill()
        wait_until(lambda: httpx.get(f"{url}/health").json()["decode_endpoints"] == [small_url])
        r = httpx.post(f"{url}/v1/completions", headers=LOW, timeout=120,
                       json={"model": "tiny", "prompt": prompt(300), "max_tokens": 3})
        assert r.status_code == 429 and r.headers.get("retry-after")
    finally:
        for p in (proc, small, big):
            p.kill()


def test_decode_endpoint_killed_mid_stream_ends_the_stream_with_an_error(vllm_server, logs):
    slow, slow_url = start_decode(logs, "decode-slow", "--num-blocks", "32", "--token-delay", "0.2")
    proc, url = start_router(logs, "router-slow", vllm_server, "--decode", slow_url)
    try:
        wait_until(lambda: len(httpx.get(f"{url}/health").json()["decode_endpoints"]) == 1)
        start = time.monotonic()
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", headers=LOW, timeout=60,
                          json={"model": "tiny", "prompt": prompt(20), "max_tokens": 40, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 4:
                    slow.kill()
        assert events[-1] == "[DONE]"
        assert "decode_error" in events[-2]
        assert time.monotonic() - start < 30
    finally:
        proc.kill()
        slow.kill()


def test_etcd_backed_pool(vllm_server, etcd, logs):
    ep, ep_url = start_decode(logs, "decode-etcd", "--num-blocks", "32", "--etcd", etcd)
    proc, url = start_router(logs, "router-etcd", vllm_server, "--etcd", etcd)
    try:
        wait_until(lambda: httpx.get(f"{url}/health").json()["decode_endpoints"] == [ep_url])
        r = httpx.post(f"{url}/v1/completions", headers=LOW, timeout=120,
                       json={"model": "tiny", "prompt": prompt(25), "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert info(ep_url)["completed"] == 1
        ep.kill()  # its lease expires and the key goes with it
        wait_until(lambda: httpx.get(f"{url}/health").json()["decode_endpoints"] == [], timeout=20)
    finally:
        proc.kill()
        ep.kill()
