"""Smaller checks of KVXferConnector against the real vLLM package: loading, claims and settings, every KV layout
vLLM 0.33 allocates, sleep mode, and what it refuses."""

from __future__ import annotations

import pytest

from vllm_consumer import CacheSpec, block_stream

pytestmark = pytest.mark.vllm


def test_loaded_by_module_path_supports_hma(vh):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from kvxfer.integrations.vllm import KVXferConnector

    ktc = vh.kvxfer_ktc(transport="tcp")
    assert KVConnectorFactory.get_connector_class(ktc) is KVXferConnector
    assert supports_hma(KVXferConnector)
    vc = vh.make_vllm_config(ktc)
    assert vc.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert KVXferConnector.supports_sleep_mode(ktc) is True
    assert KVXferConnector.get_required_kvcache_layout(vc) is None


def test_parse_claim_and_settings(vh):
    from kvxfer.integrations.vllm import Settings, parse_claim

    s = Settings.from_extra(
        {"transport": "tcp", "deadline": 5, "digests": True, "allowed_consumers": ["10.0.0.1", "decode-2:7000"]}
    )
    assert parse_claim(None, "r", s) is None
    assert parse_claim({"do_remote_decode": True}, "r", s) is None
    c = parse_claim({"kvxfer": {"consumer": "10.0.0.1:9000", "meta": {"a": [1, 2]}, "deadline": 60}}, "r", s)
    assert c.error is None and c.transfer_id == "r" and c.deadline == 5 and c.digests is True
    c = parse_claim({"kvxfer": {"consumer": "decode-2:7000", "request_id": "d-1", "digests": False}}, "r", s)
    assert c.error is None and c.transfer_id == "d-1" and c.digests is False
    for bad in (
        {"kvxfer": None},
        {"kvxfer": {}},
        {"kvxfer": {"consumer": "decode-2:7001"}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "meta": "x"}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "meta": {"f": object()}}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "meta": {"f": b"bytes"}}},  # encodable, but the wire's meta is JSON-like
        {"kvxfer": {"consumer": "10.0.0.1:1", "meta": {"f": "x" * (2 << 20)}}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "request_id": "r" * 5000}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "deadline": -1}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "request_id": ""}},
        {"kvxfer": {"consumer": "10.0.0.1:1", "lease": 5}},  # a lease is for a hold
    ):
        c = parse_claim(bad, "r", s)
        assert c is not None and c.error, bad
    held = Settings.from_extra({"listen": "127.0.0.1:5600", "lease": 20})
    assert parse_claim({"kvxfer": {}}, "r", held).lease == 20
    assert parse_claim({"kvxfer": {"lease": 2.5}}, "r", held).lease == 2.5
    assert parse_claim({"kvxfer": {"lease": 99}}, "r", held).lease == 20  # capped by the configured lease
    for bad_lease in (0, -1, "soon"):
        assert parse_claim({"kvxfer": {"lease": bad_lease}}, "r", held).error
    assert Settings.from_extra({"spin": 0}).spin == 0 and Settings.from_extra({}).spin == 1e-4
    for bad_spin in (-1, 1, "nan"):
        with pytest.raises(ValueError, match="spin"):
            Settings.from_extra({"spin": bad_spin})
    with pytest.raises(ValueError):
        Settings.from_extra({"deadline": 0})
    with pytest.raises(ValueError):
        Settings.from_extra({"allowed_consumers": "10.0.0.1"})
    import os

    os.environ["KVXFER_TEST_TOKEN"] = "s3cret"
    assert Settings.from_extra({"auth_env": "KVXFER_TEST_TOKEN"}).auth == "s3cret"


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_registers_every_vllm_kv_layout(vh, layout):
    """vLLM's own allocate_kv_cache views (per-layer, NHD / HND / cross-layer interleaved): the registered byte
    stream of each block is that block of every layer, in memory order."""
    e = vh.Engine(vh.kvxfer_ktc(transport="tcp"), num_blocks=12, layout=layout)
    try:
        lay = e.worker.kvxfer.producer.layout
        fp = lay.fingerprint
        assert (fp.num_layers, fp.block_size, fp.dtype) == (2, 16, "bfloat16")
        assert lay.num_blocks == e.kvc.num_blocks and len(lay.regions) == 1  # one allocation, one region
        for b in (0, 1, lay.num_blocks - 1):
            want = b"".join(vh.physical_block_bytes(e.worker.kv_caches[name], b) for name in vh.LAYERS)
            assert block_stream(lay, b) == want
    finally:
        e.close()


def test_sleep_mode_unregister_and_restore(vh, engines, consumers):
    c = consumers(spec=CacheSpec())
    e = engines(vh.kvxfer_ktc(transport="tcp", deadline=5))
    w = e.worker.kvxfer
    first = w.producer
    w.unregister_kv_caches()
    assert w.producer is None and first.closed
    e.add(vh.make_request("asleep", 40, 1, {"kvxfer": {"consumer": c.address}}, seed=81))
    e.run(timeout=10)  # no registration: the order fails at once and is still reported
    assert e.finished_sending == {"asleep": 1}
    w.restore_kv_caches()
    assert w.producer is not None and w.producer is not first
    e.add(vh.make_request("awake", 40, 1, {"kvxfer": {"consumer": c.address}}, seed=82))
    e.run(timeout=10)
    a = c.get(10)
    assert a["req"] == "awake" and vh.expected_tokens_ok(a, e.prompts["awake"], 16) == 40
    e.assert_no_leaks()


def test_roles_and_hold_settings(vh, engines):
    from kvxfer.integrations.vllm import Settings

    for role in ("kv_consumer", "kv_both"):
        e = engines(vh.kvxfer_ktc(transport="tcp", listen=f"127.0.0.1:{vh.free_port()}", role=role))
        assert e.kvxfer.connector_scheduler.fetch and (e.kvxfer.connector_scheduler.produce == (role == "kv_both"))
        w = e.worker.kvxfer.connector_worker
        assert w.consumer is not None and (w.producer is not None) == (role == "kv_both")
        assert w.consumer.allocator.num_free == 0  # fetches land in vLLM's blocks; pushes are refused Busy
    with pytest.raises(ValueError, match="concrete port"):
        Settings.from_extra({"listen": "127.0.0.1:0"})
    with pytest.raises(ValueError, match="bad listen"):
        Settings.from_extra({"listen": "nowhere"})
    with pytest.raises(ValueError, match="lease"):
        Settings.from_extra({"lease": 0})
    s = Settings.from_extra({"listen": "10.0.0.5:5600", "lease": 7, "consumer_listen": "10.0.0.6:0"})
    assert (s.listen, s.lease, s.consumer_listen) == ("10.0.0.5:5600", 7.0, "10.0.0.6:0")


def test_pyproject_pins_the_supported_vllm_range():
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm>=0.32,<0.34"]


def test_kernel_blocks_smaller_than_manager_blocks(vh, consumers):
    """vLLM may split each 16-token manager block into kernel blocks (here 2 x 8 tokens, as the attention backend
    asks): the worker ships manager block b as kernel blocks 2b, 2b+1, byte for byte."""
    import time

    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvxfer.integrations.vllm import KVXferConnectorMetadata, ShipOrder

    c = consumers(spec=CacheSpec(num_blocks=16, block_size=8))
    vc = vh.make_vllm_config(vh.kvxfer_ktc(transport="tcp", deadline=10, digests=True))
    kvc = vh.make_kv_cache_config(vc, 12)
    kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC, kernel_block_sizes=[8])
    for t in {id(t): t for t in kv.values()}.values():
        t.view(torch.int16).copy_(torch.randint(-3000, 3000, t.shape, dtype=torch.int16))
    w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
    try:
        w.register_kv_caches(kv)
        lay = w.producer.layout
        assert (
            w.connector_worker.ratio == 2 and lay.num_blocks == 2 * kvc.num_blocks and lay.fingerprint.block_size == 8
        )
        order = ShipOrder(
            req_id="k",
            transfer_id="k",
            consumer=c.address,
            block_ids=[3, 5],
            num_tokens=30,
            attempt=1,
            deadline=10,
            digests=True,
            meta={},
        )
        w.bind_connector_metadata(KVXferConnectorMetadata(ship=[order]))
        w.wait_for_save()
        w.clear_connector_metadata()
        a = c.get(10)
        assert a["blocks"] == [block_stream(lay, b) for b in (6, 7, 10, 11)] and a["digests"] == 16
        end = time.monotonic() + 5
        while w.pending().get("k") != "done" and time.monotonic() < end:
            time.sleep(0.01)
        assert w.pending()["k"] == "done"
    finally:
        w.shutdown()


def test_multiconnector_stats_are_rebuilt_by_name_in_a_process_that_never_imported_the_connector(vh):
    """vLLM's API server rebuilds a MultiConnector's per-child stats by registered connector name; the kvxfer
    entry point (``vllm.general_plugins``) registers it there, else the first stats end that server."""
    import importlib.metadata

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("kvxfer") == "kvxfer.integrations.vllm.plugin:register"
    from kvxfer.integrations.vllm import KVXferConnector, KVXferStats, register

    register()
    register()  # idempotent: vLLM loads plugins once per process, tests may call it again
    assert KVConnectorFactory.get_connector_class_by_name("KVXferConnector") is KVXferConnector
    sent = KVXferStats()
    sent.record("fetch", nbytes=4096, seconds=0.5, ok=True)
    rebuilt = MultiConnector.build_kv_connector_stats(data={"KVXferConnector": sent.data})
    assert isinstance(rebuilt.data["KVXferConnector"], KVXferStats)
    assert rebuilt.data["KVXferConnector"].data == sent.data
