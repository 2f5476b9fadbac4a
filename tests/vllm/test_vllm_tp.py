"""The connector under tensor parallelism, in vLLM 0.33's real worker classes: one worker-role KVXferConnector per
TP rank (made by vLLM's connector factory from a config with ``tensor_parallel_size=2`` and the rank's own
``parallel_config.rank``), each registering vLLM-allocated KV tensors that hold its half of the kv heads, each
pushing its heads as one part of a multi-sender request to a real Consumer that holds every head. The consumer's
blocks must equal the two ranks' heads side by side; what stays refused at start-up is refused with a message.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch


def _rank_config(vh, tp_rank: int, **extra):
    vc = vh.make_vllm_config(vh.kvxfer_ktc(role="kv_producer", transport="tcp", deadline=10, **extra))
    vc.parallel_config.tensor_parallel_size = 2
    vc.parallel_config.rank = tp_rank
    return vc


def _cache_config(vh, vc, heads: int, num_blocks: int, layers=None):
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    names = list(vh.LAYERS if layers is None else layers)
    spec = FullAttentionSpec(
        block_size=vc.cache_config.block_size, num_kv_heads=heads, head_size=vh.HEAD, dtype=vh.DTYPE
    )
    groups = [KVCacheGroupSpec(names, spec)]
    return get_kv_cache_config_from_groups(vc, groups, spec.page_size_bytes * len(names) * num_blocks)


def _ship(workers, consumer, rid: str, transfer_id: str, src: list[int], block: int):
    """The scheduler is rank-agnostic: every rank gets the same ship order; each must report it done, and the
    consumer's arrival is returned."""
    from kvxfer.integrations.vllm import KVXferConnectorMetadata, ShipOrder

    order = ShipOrder(rid, transfer_id, consumer.address, src, len(src) * block, 1, 10.0, False, {})
    for w in workers:
        w.bind_connector_metadata(KVXferConnectorMetadata(ship=[copy.deepcopy(order)]))
        w.wait_for_save()
        w.clear_connector_metadata()
    assert [_wait_ended(w, rid) for w in workers] == [(1, "done", None)] * len(workers)
    a = consumer.get(10)
    assert a.req == transfer_id
    return a


def test_two_tp_ranks_push_their_heads_into_one_consumer(vh):
    vh.init_single_process_world(vh.make_vllm_config(None))  # as other tests leave it: a TP group of 1 here
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvxfer import Consumer, KVLayout

    blocks = 12
    full_vc = vh.make_vllm_config(None)
    full = allocate_kv_cache(_cache_config(vh, full_vc, vh.KV_HEADS, blocks), torch.device("cpu"), KVCacheLayout.LBHNC)
    for t in full.values():
        t.zero_()
    consumer = Consumer(KVLayout.from_tensors(full), transport="tcp", deadline=10)
    workers, caches = [], []
    try:
        for r in range(2):
            vc = _rank_config(vh, r)
            kvc = _cache_config(vh, vc, vh.KV_HEADS // 2, blocks)
            kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC)
            g = torch.Generator().manual_seed(r + 1)
            for t in kv.values():
                t.view(torch.int16).copy_(torch.randint(-3000, 3000, t.shape, generator=g, dtype=torch.int16))
            w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
            w.register_kv_caches(kv)
            workers.append(w)
            caches.append(kv)
        src = [3, 7, 1]
        a = _ship(workers, consumer, "r1", "tp-req", src, full_vc.cache_config.block_size)
        for name, t in full.items():  # vLLM's CPU view: [blocks, kv heads, block, K|V]
            got = t[torch.as_tensor(a.block_ids)]
            want = torch.cat([caches[r][name][src] for r in range(2)], dim=1)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
            others = [b for b in range(blocks) if b not in set(a.block_ids.tolist())]
            assert not t[others].view(torch.int16).any(), "bytes landed outside the granted blocks"
        assert consumer.release("tp-req")
    finally:
        for w in workers:
            w.shutdown()
        consumer.close()


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)], ids=["pp2", "tp2-pp2"])
def test_pipeline_stages_push_their_layers_into_one_consumer(vh, tp, pp):
    """Each worker holds its stage's layers (and under TP its half of the heads): vLLM registers only those, and
    the connector reads which layers they are off the names. Every rank pushes its share as one part; the
    consumer's blocks equal the ranks' caches put together."""
    vh.init_single_process_world(vh.make_vllm_config(None))
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvxfer import Consumer, KVLayout

    blocks, per_stage = 12, len(vh.LAYERS) // pp
    full_vc = vh.make_vllm_config(None)
    full = allocate_kv_cache(_cache_config(vh, full_vc, vh.KV_HEADS, blocks), torch.device("cpu"), KVCacheLayout.LBHNC)
    for t in full.values():
        t.zero_()
    consumer = Consumer(KVLayout.from_tensors(full), transport="tcp", deadline=10)
    workers, caches = [], {}
    try:
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                vc = _rank_config(vh, pp_rank * tp + tp_rank)
                vc.parallel_config.tensor_parallel_size, vc.parallel_config.pipeline_parallel_size = tp, pp
                names = vh.LAYERS[pp_rank * per_stage : (pp_rank + 1) * per_stage]
                kvc = _cache_config(vh, vc, vh.KV_HEADS // tp, blocks, names)
                kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC)
                g = torch.Generator().manual_seed(10 * pp_rank + tp_rank)
                for t in kv.values():
                    t.view(torch.int16).copy_(torch.randint(-3000, 3000, t.shape, generator=g, dtype=torch.int16))
                caches[(pp_rank, tp_rank)] = kv
                w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
                w.register_kv_caches(kv)
                workers.append(w)
        src = [3, 7, 1]
        a = _ship(workers, consumer, "r1", "pp-req", src, full_vc.cache_config.block_size)
        for li, name in enumerate(vh.LAYERS):
            stage = li // per_stage
            want = torch.cat([caches[(stage, r)][name][src] for r in range(tp)], dim=1)
            got = full[name][torch.as_tensor(a.block_ids)]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        assert consumer.release("pp-req")
    finally:
        for w in workers:
            w.shutdown()
        consumer.close()


def _wait_ended(w, rid: str, timeout: float = 15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        meta = w.build_connector_worker_meta()
        if meta is not None and rid in meta.ended:
            return meta.ended[rid]
        time.sleep(0.01)
    raise AssertionError(f"{rid} never ended on the worker")


@pytest.mark.parametrize(
    "role,tp,pp,match",
    [
        ("kv_consumer", 2, 1, "only kv_role 'kv_producer'"),
        ("kv_both", 2, 1, "only kv_role"),
        ("kv_consumer", 1, 2, "only kv_role"),
    ],
)
def test_what_stays_refused_under_parallelism_says_so(vh, role, tp, pp, match):
    from kvxfer.integrations.vllm import KVXferConnector

    vc = vh.make_vllm_config(vh.kvxfer_ktc(role=role, transport="tcp"))
    vc.parallel_config.tensor_parallel_size = tp
    vc.parallel_config.pipeline_parallel_size = pp
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with pytest.raises(ValueError, match=match):
        KVXferConnector(vc, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(vc, 8))


@pytest.mark.parametrize("tp", [2, 4])
def test_an_mla_cache_on_every_rank_ships_once_striped_by_layer(vh, monkeypatch, tp):
    """An MLA model keeps its whole latent cache on every TP rank: each rank ships the layers ``l % tp == rank``
    as one part, so every layer crosses once and the consumer's blocks equal the (replicated) cache; with more
    ranks than layers the extra ranks ship nothing and report done."""
    vh.init_single_process_world(vh.make_vllm_config(None))
    from vllm.config import ModelConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvxfer import Consumer, KVLayout

    monkeypatch.setattr(ModelConfig, "use_mla", property(lambda self: True))  # the tiny model's config is Llama's
    blocks = 12
    full_vc = vh.make_vllm_config(None)
    full = allocate_kv_cache(_cache_config(vh, full_vc, vh.KV_HEADS, blocks), torch.device("cpu"), KVCacheLayout.LBHNC)
    for t in full.values():
        t.zero_()
    consumer = Consumer(KVLayout.from_tensors(full), transport="tcp", deadline=10)
    g = torch.Generator().manual_seed(7)
    latent = {n: torch.randint(-3000, 3000, t.shape, generator=g, dtype=torch.int16) for n, t in full.items()}
    workers = []
    try:
        for r in range(tp):
            vc = _rank_config(vh, r)
            vc.parallel_config.tensor_parallel_size = tp
            kvc = _cache_config(vh, vc, vh.KV_HEADS, blocks)
            kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC)
            for n, t in kv.items():
                t.view(torch.int16).copy_(latent[n])  # a replica: the same bytes on every rank
            w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
            w.register_kv_caches(kv)
            workers.append(w)
        layers = len(full)
        stripes = [w.connector_worker._part() for w in workers]
        assert stripes == [
            {"senders": min(tp, layers), "part": r, "layers": tuple(range(r, layers, tp))} if r < layers else None
            for r in range(tp)
        ]
        src = [3, 7, 1]
        a = _ship(workers, consumer, "r1", "mla-req", src, full_vc.cache_config.block_size)
        for name, t in full.items():
            assert torch.equal(t[torch.as_tensor(a.block_ids)].view(torch.int16), latent[name][src]), name
        assert consumer.release("mla-req")
    finally:
        for w in workers:
            w.shutdown()
        consumer.close()


def test_a_hold_claim_under_tensor_parallelism_is_answered_not_held_with_the_reason(vh):
    """The scheduler side knows the TP size: a claim naming no consumer (a hold for a fetch) is refused with a
    reason, and a push claim is taken."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer.integrations.vllm import KVXferConnector
    from kvxfer.integrations.vllm.settings import HOLD, PUSH, parse_claim

    vc = _rank_config(vh, 0, listen=f"127.0.0.1:{vh.free_port()}")
    c = KVXferConnector(vc, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(vc, 8))
    hold = parse_claim({"kvxfer": {}}, "r", c.settings)
    assert hold is not None and hold.kind == HOLD and "tensor or pipeline parallelism" in (hold.error or "")
    push = parse_claim({"kvxfer": {"consumer": "127.0.0.1:9"}}, "r", c.settings)
    assert push is not None and push.kind == PUSH and not push.error
