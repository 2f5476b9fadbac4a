"""KVXferConnector as one child of vLLM's MultiConnector, beside vLLM's own NixlConnector, both sides real: one
prefill instance, one batch, requests for the regular P/D pool (Nixl), for kvxfer, for both, and for neither."""

from __future__ import annotations

import os
import time

import pytest

from vllm_consumer import CacheSpec

pytestmark = pytest.mark.vllm

NIXL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id"}


@pytest.fixture
def nixl(vh):
    if not vh.nixl_alias():
        if os.environ.get("CI"):
            pytest.fail("NIXL (nixl-cu13) is not importable in CI")
        pytest.skip("NIXL not installed")


def test_multiconnector_beside_nixl_one_batch(vh, nixl, engines, consumers):
    c = consumers(spec=CacheSpec(num_blocks=64, block_size=32))
    ktc = vh.multi_ktc({"transport": "tcp", "deadline": 10, "digests": True}, nixl_extra={"kv_lease_duration": 3})
    # Nixl's CPU worker wants a block size that is a multiple of 32 (CPU attention kernel blocks)
    e = engines(ktc, block=32, num_blocks=64, max_batched=128, setup=vh.init_single_process_world)
    assert [type(x).__name__ for x in e.sched.connector._connectors] == ["KVXferConnector", "NixlPullConnector"]
    assert [type(x).__name__ for x in e.worker.connector._connectors] == ["KVXferConnector", "NixlPullConnector"]
    assert e.vc.scheduler_config.disable_hybrid_kv_cache_manager is False  # SupportsHMA: HMA stays on

    kvx = {"consumer": c.address}
    reqs = {
        "kvx": (100, {"kvxfer": kvx}),
        "pd": (60, {"do_remote_decode": True}),  # the regular pool: Nixl's P side
        "both": (70, {"do_remote_decode": True, "kvxfer": kvx}),  # both children hold its blocks
        "plain": (50, None),
        "kvx-chunked": (300, {"kvxfer": kvx}),  # 128 + 128 + 44 tokens
    }
    for i, (rid, (n, params)) in enumerate(reqs.items()):
        e.add(vh.make_request(rid, n, 1, params, seed=70 + i, block=32))
    e.run(timeout=30)

    out = {rid: e.outputs[rid]["kv_transfer_params"] for rid in reqs}
    assert out["plain"] is None
    assert set(out["kvx"]) == {"kvxfer"} and set(out["kvx-chunked"]) == {"kvxfer"}
    assert "kvxfer" not in out["pd"] and out["pd"].get("do_remote_prefill") is True
    assert "kvxfer" in out["both"] and out["both"].get("do_remote_prefill") is True  # merged, no key clash
    assert set(out["both"]) - {"kvxfer"} == set(out["pd"])

    arrivals = {a["req"]: a for a in (c.get(10) for _ in range(3))}
    assert sorted(arrivals) == ["both", "kvx", "kvx-chunked"]
    for rid, a in arrivals.items():
        assert vh.expected_tokens_ok(a, e.prompts[rid], 32) == reqs[rid][0]
        assert a["blocks"] == e.worker.shipped[rid]
    # every held request was released exactly once, after every child that held it reported it
    assert set(e.finished_sending) == {"kvx", "kvx-chunked", "pd", "both"}
    e.assert_no_leaks()
    assert c.stats()["completed"] == 3


def test_pd_hold_and_fetch_under_multiconnector_beside_nixl(vh, nixl, engines, monkeypatch):
    """Prefill (kv_producer) and decode (kv_consumer) both run KVXferConnector under MultiConnector beside a real
    NixlConnector: a kvxfer ticket is held and fetched through the kvxfer child, Nixl's keys never clash with it,
    and both pools end full."""
    block = 32
    port = vh.free_port()
    extra = {"transport": "tcp", "deadline": 10}
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(vh.free_port()))
    p = engines(
        vh.multi_ktc({**extra, "listen": f"127.0.0.1:{port}"}, role="kv_producer"),
        block=block,
        num_blocks=64,
        max_batched=128,
        setup=vh.init_single_process_world,
    )
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(vh.free_port()))
    d = engines(vh.multi_ktc(extra, role="kv_consumer"), block=block, num_blocks=64, max_batched=128)
    n = 100
    p.add(vh.make_request("p", n, 1, {"kvxfer": {"request_id": "kvx-m"}}, seed=3, block=block))
    p.run(until=lambda e: "kv_transfer_params" in e.outputs.get("p", {}))
    params = p.outputs["p"]["kv_transfer_params"]
    assert set(params) == {"kvxfer"} and params["kvxfer"]["status"] == "held"
    d.add(vh.make_request("d", n, 2, params, seed=3, block=block))
    t0 = time.monotonic()
    while p.busy() or d.busy():
        assert time.monotonic() - t0 < 30, (p.kvxfer.pending(), d.kvxfer.pending())
        for e in (p, d):
            if e.busy():
                e.step()
    assert d.first_computed["d"] == n - 1  # loaded through the kvxfer child
    r = d.outputs["d"]["kv_transfer_params"]
    assert set(r) == {"kvxfer"} and r["kvxfer"]["status"] == "fetched", r
    toks = vh.prompt_tokens(n, 3)
    table = d.worker.tables_seen["d"]
    for pos in range(n - 1):
        for li, name in enumerate(vh.LAYERS):
            got = d.worker.kv_caches[name][table[pos // block], :, pos % block, :]
            assert bool((got == vh.slot_value(toks[pos], pos, li)).all()), (pos, li)
    assert d.stats is not None
    p.assert_no_leaks()
    d.assert_no_leaks()
