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


def _ships_the_latent_cache(workers, consumer, cache, latent, req: str, block: int) -> None:
    """Every rank gets the same ship order; the consumer's blocks (``cache``) then equal the latent cache, which
    every rank holds a replica of."""
    src = [3, 7, 1]
    a = _ship(workers, consumer, "r1", req, src, block)
    for name, t in cache.items():
        assert torch.equal(t[torch.as_tensor(a.block_ids)].view(torch.int16), latent[name][src]), name
    assert consumer.release(req)


def _wait_ended(w, rid: str, timeout: float = 15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        meta = w.build_connector_worker_meta()
        if meta is not None and rid in meta.ended:
            return meta.ended[rid]
        time.sleep(0.01)
    raise AssertionError(f"{rid} never ended on the worker")


def test_an_mla_cache_under_tp_and_pp_ships_each_stage_striped_once(vh, monkeypatch):
    """MLA under TP 2 x PP 2: every rank of a stage holds the stage's latent layers whole; each stage's ranks
    stripe its layers (one layer per stage here, so one sender per stage and the other rank ships nothing), and
    the consumer's blocks equal the latent cache."""
    vh.init_single_process_world(vh.make_vllm_config(None))
    from vllm.config import ModelConfig

    from kvxfer import Consumer, KVLayout

    monkeypatch.setattr(ModelConfig, "use_mla", property(lambda self: True))
    blocks, H, block = 12, vh.KV_HEADS, vh.make_vllm_config(None).cache_config.block_size
    g = torch.Generator().manual_seed(11)
    full = {
        n: torch.randint(-3000, 3000, (blocks, H, block, 2 * vh.HEAD), generator=g, dtype=torch.int16)
        for n in vh.LAYERS
    }

    def latent(name, hs, t):
        t.view(torch.int16).copy_(full[name])

    workers, _ = _instance(vh, "kv_producer", 2, 2, lambda k: (0, H), blocks, latent)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    whole = allocate_kv_cache(
        _cache_config(vh, vh.make_vllm_config(None), H, blocks), torch.device("cpu"), KVCacheLayout.LBHNC
    )
    for t in whole.values():
        t.zero_()
    consumer = Consumer(KVLayout.from_tensors(whole), transport="tcp", deadline=10)
    try:
        parts = [w.connector_worker._part() for w in workers]
        assert parts == [
            {"senders": 2, "part": 0, "layers": (0,)},
            None,
            {"senders": 2, "part": 1, "layers": (1,)},
            None,
        ]
        _ships_the_latent_cache(workers, consumer, whole, full, "mla-pp", block)
    finally:
        for w in workers:
            w.shutdown()
        consumer.close()


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
        _ships_the_latent_cache(workers, consumer, full, latent, "mla-req", full_vc.cache_config.block_size)
    finally:
        for w in workers:
            w.shutdown()
        consumer.close()


def _instance(vh, role: str, tp: int, pp: int, heads_of_rank, blocks: int, fill, **extra):
    """One vLLM instance's worker ranks, as vLLM makes them: rank ``pp_rank * tp + tp_rank`` registers its heads
    (``heads_of_rank(tp_rank)``) of its stage's layers, filled by ``fill(name, tp_rank, tensor)``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    per_stage = len(vh.LAYERS) // pp
    workers, caches = [], []
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            vc = vh.make_vllm_config(vh.kvxfer_ktc(role=role, transport="tcp", deadline=10, **extra))
            vc.parallel_config.tensor_parallel_size, vc.parallel_config.pipeline_parallel_size = tp, pp
            vc.parallel_config.rank = pp_rank * tp + tp_rank
            names = vh.LAYERS[pp_rank * per_stage : (pp_rank + 1) * per_stage]
            h0, h1 = heads_of_rank(tp_rank)
            kvc = _cache_config(vh, vc, h1 - h0, blocks, names)
            kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC)
            for name, t in kv.items():
                fill(name, (h0, h1), t)
            w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
            w.register_kv_caches(kv)
            workers.append(w)
            caches.append(kv)
    return workers, caches


def _wait_recved(w, rid: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _, recving = w.get_finished(set())
        if recving and rid in recving:
            return
        time.sleep(0.01)
    raise AssertionError(f"{rid} never reported received")


PD_CASES = [(2, 1, 1, 1), (1, 1, 2, 1), (2, 1, 2, 1), (4, 1, 1, 1), (1, 1, 4, 1), (1, 2, 1, 1), (2, 2, 1, 2)]
PD_CASES = [(*c, False, False) for c in PD_CASES] + [
    (2, 1, 1, 1, True, False),
    (1, 1, 2, 1, True, False),
    (4, 1, 2, 1, True, False),
    (2, 2, 1, 1, True, False),
    (2, 1, 1, 1, False, True),
    (1, 1, 4, 1, False, True),
    (4, 1, 1, 1, False, True),
]


@pytest.mark.parametrize(
    "p,q,d,r,mla,groups",
    PD_CASES,
    ids=[f"tp{p}pp{q}-into-tp{d}pp{r}{'-mla' * m}{'-2groups' * g}" for p, q, d, r, m, g in PD_CASES],
)
def test_a_parallel_prefill_holds_and_a_parallel_decode_fetches_its_share(vh, monkeypatch, p, q, d, r, mla, groups):
    """A prefill of TP ``p`` x PP ``q`` holds a request on every rank (``ranks``: rank g listens on the port + g
    and holds ``<id>@<g>``); a decode of TP ``d`` x PP ``r`` gets one fetch order per rank, as the rank-agnostic
    scheduler sends it, and each decode rank fetches its heads of its layers from the prefill ranks holding them
    (with 2 kv heads, TP 4 replicates each head on two ranks: the unread replicas are declined). Every decode
    rank's blocks equal the reference's; every prefill rank's hold ends done or declined, and every decode rank
    reports the request received. MLA: every rank holds the latent cache whole; decode rank ``c`` reads it from
    prefill rank ``c % p`` (of each stage holding its layers), the others are declined. Two KV-cache groups (a
    hybrid model; here the second a window's tail of two blocks): every rank holds each group (``<id>@<g>#1``) and
    every decode rank reads each."""
    vh.init_single_process_world(vh.make_vllm_config(None))
    from vllm.config import ModelConfig

    from kvxfer.integrations.vllm import FetchOrder, KVXferConnectorMetadata, ShipOrder
    from kvxfer.shard import heads_of

    if mla:
        monkeypatch.setattr(ModelConfig, "use_mla", property(lambda self: True))
    split = (lambda n: lambda k: (0, vh.KV_HEADS)) if mla else (lambda n: lambda k: heads_of(k, n, vh.KV_HEADS))

    H, blocks, block = vh.KV_HEADS, 12, vh.make_vllm_config(None).cache_config.block_size
    g = torch.Generator().manual_seed(p * 100 + q * 10 + d)
    full = {
        n: torch.randint(-3000, 3000, (blocks, H, block, 2 * vh.HEAD), generator=g, dtype=torch.int16)
        for n in vh.LAYERS
    }

    def reference(name, hs, t):  # vLLM's CPU view: [blocks, kv heads, block, K|V]
        t.view(torch.int16).copy_(full[name][:, hs[0] : hs[1]])

    def zero(name, hs, t):
        t.zero_()

    base = vh.free_port(p * q)
    prefill, _ = _instance(vh, "kv_producer", p, q, split(p), blocks, reference, listen=f"127.0.0.1:{base}")
    decode, dcaches = _instance(vh, "kv_consumer", d, r, split(d), blocks, zero)
    try:
        src, dst = [3, 7, 1], [9, 0, 4]
        spans = {"src": [], "dst": []}
        if groups:  # group 1 holds prompt blocks [1, 3); the decode reads them into its own two
            src, dst = [*src, 5, 8], [*dst, 2, 6]
            spans = {"src": [(0, 3), (1, 2)], "dst": [(0, 3), (0, 2)]}
        hold = ShipOrder(
            "p1", "tp-hold", "", src, 3 * block, 1, 10.0, False, {}, lease_expires=time.time() + 20, spans=spans["src"]
        )
        for w in prefill:
            w.bind_connector_metadata(KVXferConnectorMetadata(ship=[copy.deepcopy(hold)]))
            w.wait_for_save()
            w.clear_connector_metadata()
        order = FetchOrder(
            "d1",
            "tp-hold",
            f"127.0.0.1:{base}",
            dst,
            0,
            3 * block,
            block,
            "",
            time.time() + 20,
            10.0,
            (p, q),
            spans=spans["dst"],
        )
        for w in decode:
            w.bind_connector_metadata(KVXferConnectorMetadata(fetch=[copy.deepcopy(order)]))
            w.start_load_kv(None)
            w.clear_connector_metadata()
        for w in decode:
            _wait_recved(w, "d1")
            assert not w.get_block_ids_with_load_errors()
        ended = [_wait_ended(w, "p1") for w in prefill]
        assert all(e[1] in ("done", "cancelled") for e in ended), ended
        assert sum(e[1] == "done" for e in ended) >= 1
        per_stage = len(vh.LAYERS) // r
        for k, kv in enumerate(dcaches):
            tp_rank, stage = k % d, k // d
            h0, h1 = split(d)(tp_rank)
            for name in vh.LAYERS[stage * per_stage : (stage + 1) * per_stage]:
                got = kv[name][dst].view(torch.int16)
                assert torch.equal(got, full[name][src][:, h0:h1]), (k, name)
                others = [b for b in range(blocks) if b not in dst]
                assert not kv[name][others].view(torch.int16).any(), "bytes landed outside the fetched blocks"
    finally:
        for w in prefill + decode:
            w.shutdown()


def test_the_scheduler_takes_a_hold_under_parallelism_and_reads_the_ranks_of_a_ticket(vh):
    """A TP-2 prefill's scheduler takes a hold claim (each rank holds its share); a decode reads ``ranks`` off a
    ticket, and a malformed one (not two sizes, zero, a bool, more ports than there are) is refused by name."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer.integrations.vllm import KVXferConnector
    from kvxfer.integrations.vllm.settings import FETCH, HOLD, parse_claim

    vc = _rank_config(vh, 0, listen=f"127.0.0.1:{vh.free_port()}")
    c = KVXferConnector(vc, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(vc, 8))
    assert c.settings.parallel == (2, 1)
    hold = parse_claim({"kvxfer": {}}, "r", c.settings)
    assert hold is not None and hold.kind == HOLD and not hold.error
    ticket = {
        "status": "held",
        "address": "127.0.0.1:5000",
        "request_id": "x",
        "num_tokens": 20,
        "num_blocks": 2,
        "block_size": 16,
        "lease_expires": time.time() + 10,
    }
    fetch = parse_claim({"kvxfer": {**ticket, "ranks": [2, 4]}}, "r", c.settings)
    assert fetch is not None and fetch.kind == FETCH and fetch.ticket is not None and fetch.ticket.ranks == (2, 4)
    assert parse_claim({"kvxfer": ticket}, "r", c.settings).ticket.ranks == (1, 1)
    for bad in ([2], [0, 1], [True, 1], [2, "1"], 2, [1, 70000]):
        claim = parse_claim({"kvxfer": {**ticket, "ranks": bad}}, "r", c.settings)
        assert claim is not None and "ranks" in (claim.error or ""), bad
    far = parse_claim({"kvxfer": {**ticket, "address": "127.0.0.1:65535", "ranks": [2, 1]}}, "r", c.settings)
    assert far is not None and "no port" in (far.error or "")
