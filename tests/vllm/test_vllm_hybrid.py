"""A hybrid model in vLLM 0.33's real schedulers: layer 0 full attention (KV-cache group 0), layer 1 sliding-window
attention over 32 tokens (group 1), the two groups' tensors aliasing one allocation as vLLM lays them out. The
prefill holds each group's blocks (a window's only from the first block it keeps), the decode instance fetches them
into the blocks its own scheduler allocated in each group, and every loaded slot holds the prefill's bytes."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.vllm

BLOCK, WINDOW = 16, 32


def _pair(vh, engines, transport="tcp", *, lease=30, policy=None, **extra):
    common = {"transport": transport, "deadline": 10, **extra}
    p = engines(
        vh.kvxfer_ktc(role="kv_producer", listen=f"127.0.0.1:{vh.free_port()}", lease=lease, **common), window=WINDOW
    )
    d = engines(vh.kvxfer_ktc(role="kv_consumer", policy=policy, **common), window=WINDOW)
    return p, d


def _first_kept(tokens: int) -> int:
    """The first block vLLM's sliding-window manager keeps once ``tokens`` tokens are computed."""
    return max(0, tokens - (WINDOW - 1)) // BLOCK


def _loaded_ok(vh, d, rid, n, seed) -> int:
    """Every loaded slot the decode instance attends to holds what the prefill's attention wrote: layer 0 from the
    first token not cached here, layer 1 (the window) from the first block its window keeps."""
    toks = vh.prompt_tokens(n, seed)
    tables = d.worker.group_tables_seen[rid]
    loaded = d.first_computed[rid]
    checked = 0
    for li, name in enumerate(vh.LAYERS):
        g = d.worker.group_of[name]
        first = 0 if g == 0 else _first_kept(loaded) * BLOCK
        for pos in range(first, loaded):
            got = d.worker.kv_caches[name][tables[g][pos // BLOCK], :, pos % BLOCK, :]
            want = vh.slot_value(toks[pos], pos, li)
            assert bool((got == want).all()), (rid, pos, li, got.flatten()[:4], want)
            checked += 1
    return checked


def test_hybrid_pd_round_trip_moves_each_groups_blocks(vh, engines, transport):
    """1 token, a block multiple, a multiple plus one, a prompt longer than the window, a chunked one: the ticket
    names each group's held span, the decode loads every prompt token but the last (held without it: its window
    reaches one token further back than the prefill keeps), the bytes are the prefill's, and both pools end full."""
    p, d = _pair(vh, engines, transport, digests=True)
    sizes = {"one": 1, "exact": 32, "plus1": 33, "long": 100, "chunked": 150}
    tickets = {}
    for i, (name, n) in enumerate(sizes.items()):
        t = tickets[name] = p.prefill(f"p-{name}", n, seed=i + 1, claim={"request_id": f"kvx-{name}"})["kvxfer"]
        held = n - 1 if n > 1 else n
        assert t["status"] == "held" and t["num_tokens"] == held, t
        blocks = -(-held // BLOCK)
        assert t["groups"] == [[0, blocks], [_first_kept(held), blocks - _first_kept(held)]], t
    for i, (name, n) in enumerate(sizes.items()):
        d.add(vh.make_request(f"d-{name}", n, 3, {"kvxfer": tickets[name]}, seed=i + 1))
    vh.run_both(p, d)
    for i, (name, n) in enumerate(sizes.items()):
        rid = f"d-{name}"
        r = d.outputs[rid]["kv_transfer_params"]["kvxfer"]
        assert r["status"] == "fetched" and d.outputs[rid]["tokens"] == 3, r
        assert d.first_computed[rid] == (n - 1 if n > 1 else 0)
        assert _loaded_ok(vh, d, rid, n, i + 1) >= d.first_computed[rid]
    assert sorted(p.finished_sending) == sorted(f"p-{k}" for k in sizes) and not d.load_errors
    p.assert_no_leaks()
    d.assert_no_leaks()
    assert d.stats.data["fetch"]["failures"] == 0 and d.stats.data["fetch"]["transfers"] == len(sizes)


def test_hybrid_decode_prefix_hit_loads_the_rest_of_each_group(vh, engines):
    """The decode instance caches a prompt's first blocks locally: group 0 loads from the hit on, the window from
    the first block it keeps (when the hit ends before it), and both holds are read once."""
    p, d = _pair(vh, engines)
    n = 120
    t1 = p.prefill("p-a", n, seed=5, claim={"request_id": "kvx-a"})["kvxfer"]
    d.add(vh.make_request("d-a", n, 2, {"kvxfer": t1}, seed=5))
    vh.run_both(p, d)
    t2 = p.prefill("p-b", n, seed=5, claim={"request_id": "kvx-b"})["kvxfer"]
    d.add(vh.make_request("d-b", n, 2, {"kvxfer": t2}, seed=5))
    vh.run_both(p, d)
    order = next(o for o in d.worker.fetch_orders if o.req_id == "d-b")
    skip = order.skip
    assert skip > 0, "the second decode request had no local prefix-cache hit"
    blocks = -(-(n - 1) // BLOCK)
    window = max(skip, _first_kept(n - 1))
    assert order.spans == [(skip, blocks - skip), (window - _first_kept(n - 1), blocks - window)]
    assert _loaded_ok(vh, d, "d-b", n, 5) > 0
    assert d.outputs["d-b"]["kv_transfer_params"]["kvxfer"]["status"] == "fetched"
    p.assert_no_leaks()
    d.assert_no_leaks()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_hybrid_fetch_from_a_dead_prefill_follows_the_load_failure_policy(vh, engines, policy):
    """The prefill's worker is gone: the fetch fails and vLLM hears of it by request (block ids name no request
    across groups): it recomputes the whole prompt, or fails the request; both pools end full."""
    p, d = _pair(vh, engines, lease=5, policy=policy)
    t = p.prefill("p-x", 70, seed=3)["kvxfer"]
    p.worker.kvxfer.shutdown()
    d.add(vh.make_request("d-x", 70, 2, {"kvxfer": t}, seed=3))
    d.run(timeout=30)
    order = d.worker.fetch_orders[0]
    assert d.failed_recving == {"d-x"} and not d.load_errors and len(order.spans) == 2
    if policy == "recompute":
        assert d.outputs["d-x"]["kv_transfer_params"]["kvxfer"]["status"] == "failed"
        assert d.outputs["d-x"]["tokens"] == 2
    else:
        assert d.outputs["d-x"]["finish"] == "ERROR"
    p.run(timeout=15)  # the held blocks come back at the lease's end
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_a_ticket_whose_groups_cannot_be_mapped_frees_every_hold_at_once(vh, engines):
    """A ticket naming two groups but a window span the decode cannot map: the fetch fails before a connection,
    and the decode declines the hold of every group, so the prefill frees them now, not at its lease's end."""
    p, d = _pair(vh, engines, lease=120, policy="recompute")
    t = p.prefill("p-m", 70, seed=6)["kvxfer"]
    first, count = t["groups"][1]
    t["groups"][1] = [first + 1, count - 1]  # the window's first kept block is no longer held
    d.add(vh.make_request("d-m", 70, 2, {"kvxfer": t}, seed=6))
    d.run(timeout=20)
    r = d.outputs["d-m"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "failed" and "group 1: the prefill holds" in r["error"], r
    assert d.worker.fetch_orders[0].groups == 2 and not d.worker.fetch_orders[0].spans
    took = p.run(timeout=15)  # two declines, not a 120 s lease
    assert took < 15 and d.outputs["d-m"]["tokens"] == 2
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_a_ticket_of_a_one_group_prefill_is_refused_by_a_hybrid_decode(vh, engines):
    """A prefill of another model (one KV-cache group) into a hybrid decode: no connection, the decode computes
    the prompt itself, and the hold is still fetched by nobody (freed by its lease)."""
    p = engines(vh.kvxfer_ktc(role="kv_producer", listen=f"127.0.0.1:{vh.free_port()}", lease=3, transport="tcp"))
    d = engines(vh.kvxfer_ktc(role="kv_consumer", policy="recompute", transport="tcp"), window=WINDOW)
    t = p.prefill("p-1", 40, seed=2)["kvxfer"]
    assert "groups" not in t
    d.add(vh.make_request("d-1", 40, 2, {"kvxfer": t}, seed=2))
    d.run(timeout=20)
    r = d.outputs["d-1"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "failed" and "KV-cache group" in r["error"], r
    p.run(timeout=15)
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_a_push_of_a_windowed_model_that_decodes_on_is_refused(vh, engines, consumers):
    """A sliding window frees blocks as the request decodes: a push claim with max_tokens > 1 ships nothing and
    says why; one with max_tokens=1 ships each group's span to the consumer, its meta naming the spans."""
    from vllm_consumer import CacheSpec, block_stream

    c = consumers(spec=CacheSpec(num_blocks=64, layers=1))  # the groups alias: one tensor holds both layers
    p = engines(vh.kvxfer_ktc(role="kv_producer", transport="tcp"), window=WINDOW)
    r = p.prefill("p-long", 50, seed=4, claim={"consumer": c.address}, max_tokens=4)["kvxfer"]
    assert r["status"] == "not_sent" and "max_tokens=1" in r["error"], r
    r = p.prefill("p-one", 50, seed=4, claim={"consumer": c.address})["kvxfer"]
    p.run(timeout=20)
    assert r["groups"] == [[0, 4], [1, 3]], r
    arrival = c.get(20)
    assert arrival["req"] == "p-one" and arrival["meta"]["groups"] == [[0, 4], [1, 3]]
    order = next(o for o in p.worker.orders if o.req_id == "p-one")
    table = p.worker.group_tables_seen["p-one"]
    assert order.block_ids == table[0][:4] + table[1][1:4]
    layout = p.worker.kvxfer.producer.layout
    assert arrival["blocks"] == [block_stream(layout, b) for b in order.block_ids]
    p.assert_no_leaks()


@pytest.mark.parametrize("bad", [[[0, 2]], [[0, 2], [0]], [[-1, 2], [0, 2]], [[0, 0], [0, 2]], "x"])
def test_a_hostile_groups_field_is_a_claim_error(vh, engines, bad):
    """A ticket whose ``groups`` is malformed or names another number of groups loads nothing and fails clearly."""
    d = engines(vh.kvxfer_ktc(role="kv_consumer", policy="recompute", transport="tcp"), window=WINDOW)
    ticket = {
        "status": "held",
        "address": f"127.0.0.1:{vh.free_port()}",
        "request_id": "r",
        "num_tokens": 40,
        "num_blocks": 3,
        "block_size": BLOCK,
        "lease_expires": time.time() + 30,
        "groups": bad,
    }
    d.add(vh.make_request("d", 40, 2, {"kvxfer": ticket}, seed=1))
    d.run(timeout=20)
    r = d.outputs["d"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] in ("not_fetched", "failed") and ("groups" in r["error"] or "group" in r["error"]), r
    assert d.outputs["d"]["tokens"] == 2
    d.assert_no_leaks()


def test_hybrid_under_pipeline_parallelism_is_refused_at_start_up(vh):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvxfer.integrations.vllm import KVXferConnector

    vc = vh.make_vllm_config(vh.kvxfer_ktc(role="kv_producer"))
    vc.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="KV-cache groups under pipeline parallelism"):
        KVXferConnector(vc, KVConnectorRole.SCHEDULER, vh.make_kv_cache_config(vc, 8, WINDOW))


def _config(vh, vc, *specs):
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    groups = [KVCacheGroupSpec([name], spec) for name, spec in zip(vh.LAYERS, specs, strict=True)]
    return get_kv_cache_config_from_groups(vc, groups, specs[0].page_size_bytes * 8)


@pytest.mark.parametrize("kind", ["chunked_local", "block_sizes"])
def test_groups_it_cannot_ship_are_refused_at_start_up(vh, kind):
    """A group whose blocks are not every prompt block or a window's tail (chunked local attention), or groups
    paging with different block sizes: the connector refuses to start, saying which."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    from kvxfer.integrations.vllm import KVXferConnector

    vc = vh.make_vllm_config(vh.kvxfer_ktc(role="kv_producer"))
    geometry = {"num_kv_heads": vh.KV_HEADS, "head_size": vh.HEAD, "dtype": vh.DTYPE}
    full = FullAttentionSpec(block_size=BLOCK, **geometry)
    if kind == "chunked_local":
        other, match = ChunkedLocalAttentionSpec(block_size=BLOCK, attention_chunk_size=64, **geometry), "Chunked"
    else:
        other, match = FullAttentionSpec(block_size=2 * BLOCK, **geometry), "different block sizes"
    kvc = _config(vh, vc, full, other) if kind == "chunked_local" else _fake_config(full, other)
    with pytest.raises(ValueError, match=match):
        KVXferConnector(vc, KVConnectorRole.SCHEDULER, kvc)


def _fake_config(*specs):
    """Groups as vLLM would never plan them together (it unifies page sizes first): only the check sees them."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


def test_each_group_ships_what_vllms_window_keeps(vh):
    """The span a window ships starts at the first block vLLM's own sliding-window manager keeps, for every
    prompt length around the block and window edges."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from kvxfer.integrations.vllm.groups import Group, spans

    spec = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=vh.KV_HEADS, head_size=vh.HEAD, dtype=vh.DTYPE, sliding_window=WINDOW
    )
    skipped = SlidingWindowManager.get_num_skipped_tokens
    manager = SlidingWindowManager.__new__(SlidingWindowManager)
    manager.sliding_window, manager.extra_retained_tokens = spec.sliding_window, spec.extra_retained_tokens
    groups = (Group(0), Group(1, spec.num_retained_tokens))
    for n in range(1, 200):
        full, window = spans(groups, n, BLOCK)
        blocks = -(-n // BLOCK)
        assert full == (0, blocks)
        assert window == (skipped(manager, n) // BLOCK, blocks - skipped(manager, n) // BLOCK), n
