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
DECODE_TOKEN, ADMIN_TOKEN = "e2e-decode-token", "e2e-admin-token"
DECODE = {"authorization": f"Bearer {DECODE_TOKEN}"}  # harmless to an endpoint started without a token
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
TOKENS = {"KVXFER_DECODE_TOKEN": DECODE_TOKEN, "KVXFER_ROUTER_TOKEN": ADMIN_TOKEN}


def prompt(words: int, offset: int = 3) -> str:
    return " ".join(f"w{offset + i % 400}" for i in range(words))


def info(url: str) -> dict:
    return httpx.get(f"{url}/info", headers=DECODE, timeout=5).json()


def decode_endpoints(router_url: str) -> list:
    return httpx.get(f"{router_url}/health", headers=ADMIN, timeout=5).json()["decode_endpoints"]


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
        p, u = start_decode(logs, name, "--num-blocks", "32", env={"KVXFER_DECODE_TOKEN": DECODE_TOKEN})
        procs.append(p)
        urls.append(u)
    yield urls
    for p in procs:
        p.kill()


@pytest.fixture(scope="module")
def router(vllm_server, pool, logs):
    args = [a for u in pool for a in ("--decode", u)]
    proc, url = start_router(logs, "router", vllm_server, *args, env=TOKENS)
    wait_until(lambda: len(decode_endpoints(url)) == 2)
    yield url
    proc.kill()


def _totals(urls):
    infos = [info(u) for u in urls]
    return {k: sum(i[k] for i in infos) for k in ("completed", "failed", "verified", "handed")}


def test_low_latency_completion_ships_kv_and_decodes(router, pool):
    before = _totals(pool)
    r = httpx.post(
        f"{router}/v1/completions",
        headers=LOW,
        timeout=120,
        json={"model": "tiny", "prompt": prompt(40), "max_tokens": 8, "temperature": 0},
    )
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
    with httpx.stream(
        "POST",
        f"{router}/v1/chat/completions",
        headers=LOW,
        timeout=120,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": prompt(30, 50)}],
            "max_tokens": 6,
            "stream": True,
        },
    ) as r:
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
    r = httpx.post(
        f"{router}/v1/completions", timeout=120, json={"model": "tiny", "prompt": prompt(20), "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"].startswith("vllm") and not body.get("kv_transfer_params")
    assert _totals(pool)["completed"] == before["completed"]


def test_prefill_error_reaches_the_client(router):
    r = httpx.post(
        f"{router}/v1/completions",
        headers=LOW,
        timeout=120,
        json={"model": "tiny", "prompt": prompt(1500), "max_tokens": 4},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_busy_endpoint_is_skipped_then_all_busy_is_429(vllm_server, logs):
    small, small_url = start_decode(logs, "decode-small", "--num-blocks", "2")
    big, big_url = start_decode(logs, "decode-big", "--num-blocks", "32")
    proc, url = start_router(logs, "router-busy", vllm_server, "--decode", small_url, "--decode", big_url)
    try:
        wait_until(lambda: len(decode_endpoints(url)) == 2)
        r = httpx.post(
            f"{url}/v1/completions",
            headers=LOW,
            timeout=120,
            json={"model": "tiny", "prompt": prompt(300), "max_tokens": 3},
        )
        assert r.status_code == 200, r.text
        assert info(small_url)["completed"] == 0 and info(big_url)["completed"] == 1
        big.kill()
        wait_until(lambda: decode_endpoints(url) == [small_url])
        r = httpx.post(
            f"{url}/v1/completions",
            headers=LOW,
            timeout=120,
            json={"model": "tiny", "prompt": prompt(300), "max_tokens": 3},
        )
        assert r.status_code == 429 and r.headers.get("retry-after")
    finally:
        for p in (proc, small, big):
            p.kill()


def test_decode_endpoint_killed_mid_stream_ends_the_stream_with_an_error(vllm_server, logs):
    slow, slow_url = start_decode(logs, "decode-slow", "--num-blocks", "32", "--token-delay", "0.2")
    proc, url = start_router(logs, "router-slow", vllm_server, "--decode", slow_url)
    try:
        wait_until(lambda: len(decode_endpoints(url)) == 1)
        start = time.monotonic()
        events = []
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            headers=LOW,
            timeout=60,
            json={"model": "tiny", "prompt": prompt(20), "max_tokens": 40, "stream": True},
        ) as r:
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
        wait_until(lambda: decode_endpoints(url) == [ep_url])
        r = httpx.post(
            f"{url}/v1/completions",
            headers=LOW,
            timeout=120,
            json={"model": "tiny", "prompt": prompt(25), "max_tokens": 5},
        )
        assert r.status_code == 200, r.text
        assert info(ep_url)["completed"] == 1
        ep.kill()  # its lease expires and the key goes with it
        wait_until(lambda: decode_endpoints(url) == [], timeout=20)
    finally:
        proc.kill()
        ep.kill()


def test_router_admin_endpoints_want_the_admin_token(router, pool):
    for headers in ({}, {"authorization": "Bearer wrong"}, DECODE):
        assert httpx.get(f"{router}/metrics", headers=headers, timeout=5).status_code == 401
        assert httpx.get(f"{router}/health", headers=headers, timeout=5).json() == {"ok": True}  # liveness only
    r = httpx.get(f"{router}/metrics", headers=ADMIN, timeout=5)
    assert r.status_code == 200 and "kvxfer_router_requests" in r.text
    assert sorted(decode_endpoints(router)) == sorted(pool)


def test_router_without_the_decode_token_has_no_decode_endpoints(vllm_server, pool, logs):
    """The pool's endpoints refuse a router that does not present their token: it never routes to them."""
    proc, url = start_router(
        logs,
        "router-no-token",
        vllm_server,
        *[a for u in pool for a in ("--decode", u)],
        "--decode-token",
        "not-the-token",
        env={"KVXFER_ROUTER_TOKEN": ADMIN_TOKEN},
    )
    try:
        time.sleep(2.5)  # two probe rounds
        assert decode_endpoints(url) == []
        r = httpx.post(
            f"{url}/v1/completions",
            headers=LOW,
            timeout=30,
            json={"model": "tiny", "prompt": prompt(20), "max_tokens": 3},
        )
        assert r.status_code == 429, r.text
    finally:
        proc.kill()


# A transfer that will not complete, learnt two ways: the connector refuses the claim and says so in the prefill's
# answer (a consumer outside its allowed_consumers), or the decode endpoint never admits it (its cache does not
# match the model's: the producer's handshake is refused) and says so once --admit-timeout has passed.
REFUSALS = {
    "refused_by_the_connector": ("--kvxfer", "127.0.0.2:0"),
    "refused_by_the_decode_endpoint": ("--dtype", "float32"),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
@pytest.mark.parametrize("mode", ["error", "fallback"])
def test_failed_transfer_is_answered_within_2s(vllm_server, logs, refusal, mode):
    ep, ep_url = start_decode(logs, f"decode-{refusal}-{mode}", "--num-blocks", "32", *REFUSALS[refusal])
    proc, url = start_router(
        logs, f"router-{refusal}-{mode}", vllm_server, "--decode", ep_url, "--when-transfer-fails", mode
    )
    try:
        wait_until(lambda: decode_endpoints(url) == [ep_url])
        for stream in (False, True):
            start = time.monotonic()
            r = httpx.post(
                f"{url}/v1/completions",
                headers=LOW,
                timeout=120,
                json={"model": "tiny", "prompt": prompt(40, 7 + stream), "max_tokens": 4, "stream": stream},
            )
            elapsed = time.monotonic() - start
            assert elapsed < 2.0, (refusal, mode, stream, elapsed)
            if mode == "error":
                assert r.status_code == 502, r.text
                assert r.json()["error"]["type"] == "kv_transfer_error"
                if refusal == "refused_by_the_decode_endpoint":  # learnt from the refused handshake, no timeout
                    assert "answered 502" in r.json()["error"]["message"], r.text
            else:  # the regular pool answered: a plain vLLM completion, nothing of kvxfer in it
                assert r.status_code == 200, r.text
                if stream:
                    events = sse(r)
                    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
                    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
                else:
                    body = r.json()
                    assert body["system_fingerprint"].startswith("vllm") and not body.get("kv_transfer_params")
                    assert body["usage"]["completion_tokens"] == 4
        assert info(ep_url)["completed"] == 0 and info(ep_url)["handed"] == 0
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert 'kvxfer_router_errors_total{stage="transfer"} 2.0' in metrics
    finally:
        proc.kill()
        ep.kill()
