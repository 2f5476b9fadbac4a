"""Prefill holds, decode fetches: two real vLLM 0.33 Schedulers in one process, each with KVXferConnector loaded
by module path and its worker half driven by vLLM's own KVConnectorModelRunnerMixin over vLLM-allocated CPU KV
tensors. The prefill's fake attention writes known values into its blocks; the decode instance's attention never
writes the prompt positions it loads, and its KV tensors start as random bytes, so a correct value there proves
the byte came through kvxfer (over tcp and nixl)."""

from __future__ import annotations

import logging
import time
import types

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 16


def _pair(vh, engines, transport, *, lease=30, policy=None, prole="kv_producer", drole="kv_consumer", **extra):
    common = {"transport": transport, "deadline": 10, **extra}
    p = engines(vh.kvxfer_ktc(role=prole, listen=f"127.0.0.1:{vh.free_port()}", lease=lease, **common))
    d = engines(vh.kvxfer_ktc(role=drole, policy=policy, **common))
    return p, d


def _loaded_ok(vh, d, rid, n, seed, block=BLOCK) -> int:
    """Every prompt slot the decode instance did not compute itself holds what the prefill's attention wrote."""
    toks = vh.prompt_tokens(n, seed)
    table = d.worker.tables_seen[rid]
    first = d.first_computed[rid]
    checked = 0
    for pos in range(first):
        for li, name in enumerate(vh.LAYERS):
            got = d.worker.kv_caches[name][table[pos // block], :, pos % block, :]
            want = vh.slot_value(toks[pos], pos, li)
            assert bool((got == want).all()), (rid, pos, li, got.flatten()[:4], want)
        checked += 1
    return checked


def _held(e) -> int:
    bp = e.sched.kv_cache_manager.block_pool
    return bp.num_gpu_blocks - 1 - bp.get_num_free_blocks()


def test_pd_round_trip_moves_real_bytes(vh, engines, transport):
    """1 token, an exact block multiple, a multiple plus one, a chunked prompt (> max_num_batched_tokens): each
    decode request loads the held prompt (num_computed_tokens = prompt - 1 when first scheduled), its blocks hold
    the prefill's bytes, the prefill frees its blocks only once fetched, and both pools end full."""
    p, d = _pair(vh, engines, transport, digests=True)
    sizes = {"one": 1, "exact": 32, "plus1": 33, "chunked": 150}
    tickets = {}
    for i, (name, n) in enumerate(sizes.items()):
        params = p.prefill(f"p-{name}", n, seed=i + 1, claim={"request_id": f"kvx-{name}"})
        assert list(params) == ["kvxfer"]
        t = tickets[name] = params["kvxfer"]
        assert t["status"] == "held" and t["request_id"] == f"kvx-{name}" and t["address"] == p.kvxfer.settings.listen
        assert t["num_tokens"] == n and t["num_blocks"] == -(-n // BLOCK) and t["block_size"] == BLOCK
        assert time.time() < t["lease_expires"] <= time.time() + 30
    # the worker reported its layout id after the first step: later tickets carry it
    fp = p.worker.kvxfer.producer.layout.fingerprint_id
    assert tickets["chunked"]["fingerprint"] == fp
    # held, not freed: every prompt block is still in use and nothing was reported
    assert _held(p) == sum(-(-n // BLOCK) for n in sizes.values()) and not p.finished_sending
    assert p.kvxfer.has_pending_push_work()

    for i, (name, n) in enumerate(sizes.items()):
        d.add(vh.make_request(f"d-{name}", n, 3, {"kvxfer": tickets[name]}, seed=i + 1))
    vh.run_both(p, d)

    for i, (name, n) in enumerate(sizes.items()):
        rid = f"d-{name}"
        assert d.first_computed[rid] == n - 1, (rid, d.first_computed[rid])  # loaded, not computed
        assert _loaded_ok(vh, d, rid, n, i + 1) == n - 1
        out = d.outputs[rid]
        assert out["tokens"] == 3
        r = out["kv_transfer_params"]["kvxfer"]
        assert r["status"] == "fetched" and r["request_id"] == f"kvx-{name}" and r["skip_blocks"] == 0
        assert r["num_blocks"] == -(-n // BLOCK) and r["nbytes"] > 0, r
    assert sorted(d.finished_recving) == sorted(f"d-{k}" for k in sizes)
    assert sorted(p.finished_sending) == sorted(f"p-{k}" for k in sizes)
    assert not d.load_errors and not d.finished_sending
    p.assert_no_leaks()
    d.assert_no_leaks()
    # vLLM's connector-stats hooks: what each side moved
    block_bytes = p.worker.kvxfer.producer.layout.block_bytes
    total = sum(-(-n // BLOCK) for n in sizes.values()) * block_bytes
    ds, ps = d.stats.data, p.stats.data
    assert ds["fetch"] == {**ds["fetch"], "transfers": 4, "failures": 0, "bytes": total}
    assert ps["hold"]["transfers"] == 4 and ps["hold"]["failures"] == 0
    reduced = d.stats.reduce()
    assert reduced["kvxfer_fetch_transfers"] == 4 and reduced["kvxfer_fetch_GB/s"] > 0
    _through_vllm_logging_and_prometheus(d, total)


def _through_vllm_logging_and_prometheus(d, total: int) -> None:
    """The stats dict as vLLM's logger process gets it: its periodic log line and its Prometheus counters."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    lines = []
    logging_ = KVConnectorLogging(d.vc.kv_transfer_config)
    logging_.observe(d.stats.to_dict())
    logging_.log(lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1 and "kvxfer_fetch_transfers=4" in lines[0] and "kvxfer_fetch_failures=0" in lines[0]

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    prom = Prom(d.vc, ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe(d.stats.to_dict(), 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvxfer_fetch_bytes_total", labels) == total
    assert registry.get_sample_value("vllm:kvxfer_fetch_transfers_total", labels) == 4


def test_decode_side_prefix_hit_fetches_only_the_rest(vh, engines):
    """A decode instance that already has the first blocks of a prompt cached fetches held blocks [skip, n) into
    its table [skip, n) only."""
    p, d = _pair(vh, engines, "tcp")
    t1 = p.prefill("p-a", 40, seed=5)
    d.add(vh.make_request("d-a", 40, 2, t1, seed=5))
    vh.run_both(p, d)
    t2 = p.prefill("p-b", 70, seed=5)  # the same first 40 tokens (2 full blocks cached on the decode side)
    d.add(vh.make_request("d-b", 70, 2, t2, seed=5))
    vh.run_both(p, d)
    orders = {o.req_id: o for o in d.worker.fetch_orders}
    assert orders["d-a"].skip == 0 and len(orders["d-a"].block_ids) == 3
    assert orders["d-b"].skip == 2 and len(orders["d-b"].block_ids) == 3  # held blocks 2, 3, 4 of 5
    assert orders["d-b"].block_ids == d.worker.tables_seen["d-b"][2:5]
    assert d.worker.tables_seen["d-b"][:2] == d.worker.tables_seen["d-a"][:2]  # the local hit
    assert d.first_computed["d-b"] == 69
    assert _loaded_ok(vh, d, "d-b", 70, 5) == 69
    assert d.outputs["d-b"]["kv_transfer_params"]["kvxfer"]["skip_blocks"] == 2
    p.assert_no_leaks()
    d.assert_no_leaks()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_fetch_follows_the_load_failure_policy(vh, engines, policy):
    """The hold is gone (the prefill's worker shut down after holding): the fetch fails, its blocks are reported
    through get_block_ids_with_load_errors in the same step as finished_recving; "recompute" computes the
    prompt locally, "fail" fails the request; no block leaks on either side."""
    p, d = _pair(vh, engines, "tcp", policy=policy)
    t = p.prefill("p-x", 50, seed=9)
    p.worker.kvxfer.connector_worker.unregister_kv_caches()  # the prefill's holds end (cancelled), its listener closes
    p.run()  # the prefill frees the blocks once the hold ended
    p.assert_no_leaks()
    d.add(vh.make_request("d-x", 50, 2, t, seed=9))
    d.run()
    (order,) = d.worker.fetch_orders
    assert d.load_errors == set(order.block_ids)
    assert d.finished_recving == {"d-x": 1}
    out = d.outputs["d-x"]
    if policy == "recompute":
        assert out["finish"] == "LENGTH" and out["tokens"] == 2
        assert d.first_computed["d-x"] == 0  # computed here
        r = out["kv_transfer_params"]["kvxfer"]
        assert r["status"] == "failed" and r["error"].split(":")[0] in ("PeerError", "StaleError"), r
    else:
        assert out["finish"] == "ERROR" and out["tokens"] == 0
        assert out["kv_transfer_params"] is None  # vLLM sends no kv_transfer_params with an errored request
        assert "d-x" not in d.first_computed
    assert d.stats.data["fetch"]["failures"] == 1
    d.assert_no_leaks()


def test_layout_mismatch_fails_fast_without_a_connection(vh, engines):
    p, d = _pair(vh, engines, "tcp", policy="recompute")
    t = p.prefill("p-m", 20, seed=3)
    t["kvxfer"]["fingerprint"] = "0" * 32  # a prefill whose layout differs
    d.add(vh.make_request("d-m", 20, 1, t, seed=3))
    d.run()
    r = d.outputs["d-m"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "failed" and "IncompatibleError" in r["error"] and "layout mismatch" in r["error"], r
    assert not d.worker.kvxfer.consumer.fetches.sessions  # refused before any connection to the prefill
    assert d.first_computed["d-m"] == 0 and d.outputs["d-m"]["tokens"] == 1
    d.assert_no_leaks()
    p.worker.kvxfer.connector_worker.unregister_kv_caches()  # end the unfetched hold
    p.run()
    p.assert_no_leaks()


@pytest.mark.parametrize("asked", [False, True], ids=["configured", "per_request"])
def test_lease_expiry_frees_the_prefill_and_the_decode_recomputes(vh, engines, asked):
    """The configured lease, or a shorter one the router asked for in the claim."""
    p, d = _pair(vh, engines, "tcp", lease=30 if asked else 0.6, policy="recompute")
    t = p.prefill("p-l", 40, seed=4, claim={"lease": 0.6} if asked else None)
    assert t["kvxfer"]["lease_expires"] <= time.time() + 0.6
    assert _held(p) == 3 and not p.finished_sending
    t0 = time.monotonic()
    p.run()  # kept stepping by has_pending_push_work until the lease ended
    assert 0.3 < time.monotonic() - t0 < 5
    assert p.finished_sending == {"p-l": 1}
    p.assert_no_leaks()
    assert p.stats.data["hold"]["failures"] == 1
    d.add(vh.make_request("d-l", 40, 1, t, seed=4))
    d.run()
    r = d.outputs["d-l"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "failed" and "LeaseExpiredError" in r["error"], r
    assert d.first_computed["d-l"] == 0 and d.outputs["d-l"]["tokens"] == 1
    d.assert_no_leaks()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


@pytest.mark.parametrize("lease", ["running", "over"])
def test_a_fetch_order_that_reaches_the_worker_late_says_so(vh, engines, monkeypatch, lease):
    """A stalled vLLM worker gets its fetch order long after the scheduler allocated the blocks (docs/serving.md):
    while the hold's lease still runs the fetch goes ahead with a warning naming the delay; once the lease is over
    the failure names it. The scheduler's clock is moved back, so the order reads as made 5 s before the worker
    starts it."""
    from kvxfer.integrations.vllm import scheduler as sched_mod

    p, d = _pair(vh, engines, "tcp", lease=30 if lease == "running" else 0.6, policy="recompute")
    t = p.prefill("p-late", 40, seed=8)
    if lease == "over":
        p.run()  # the lease ends, the prefill frees its blocks
    real = time.time
    monkeypatch.setattr(sched_mod, "time", types.SimpleNamespace(time=lambda: real() - 5, sleep=time.sleep))
    records = _Records()
    logging.getLogger("vllm.kvxfer").addHandler(records)
    try:
        d.add(vh.make_request("d-late", 40, 1, t, seed=8))
        d.run()
    finally:
        logging.getLogger("vllm.kvxfer").removeHandler(records)
    (order,) = d.worker.fetch_orders
    assert 4.5 < real() - order.ordered_at < 30
    r = d.outputs["d-late"]["kv_transfer_params"]["kvxfer"]
    if lease == "running":
        assert r["status"] == "fetched", r
        late = [m for level, m in records.lines if level == logging.WARNING and "reached this worker" in m]
        assert len(late) == 1 and "d-late" in late[0], records.lines
        assert _loaded_ok(vh, d, "d-late", 40, 8) == 39
        p.run()
    else:
        assert r["status"] == "failed" and "LeaseExpiredError" in r["error"], r
        assert "reached this worker 5." in r["error"], r
        assert d.first_computed["d-late"] == 0
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_kv_both_holds_and_fetches_and_never_reholds(vh, engines):
    """kv_both on both instances: a decode request carrying a ticket is fetched, not held again."""
    p, d = _pair(vh, engines, "tcp", prole="kv_both", drole="kv_both")
    t = p.prefill("p-k", 33, seed=6)
    d.add(vh.make_request("d-k", 33, 2, t, seed=6))
    vh.run_both(p, d)
    assert d.outputs["d-k"]["kv_transfer_params"]["kvxfer"]["status"] == "fetched"
    assert _loaded_ok(vh, d, "d-k", 33, 6) == 32
    assert not d.worker.orders and not d.finished_sending  # nothing held on the decode side
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_roles_refuse_what_they_do_not_do(vh, engines):
    """A producer-only instance computes a ticket-carrying request itself and says so; a consumer-only instance
    holds nothing; a response that is not a held ticket is reported back, never acted upon."""
    p, d = _pair(vh, engines, "tcp")
    t = p.prefill("p-r", 20, seed=2)
    p.add(vh.make_request("p-ticket", 20, 1, t, seed=2))  # a ticket sent to the prefill instance
    d.add(vh.make_request("d-hold", 20, 1, {"kvxfer": {}}, seed=2))  # a hold claim sent to the decode instance
    d.add(vh.make_request("d-notheld", 20, 1, {"kvxfer": {"status": "not_held", "error": "x"}}, seed=2))
    p.run(until=lambda e: "kv_transfer_params" in e.outputs.get("p-ticket", {}))
    d.run()
    r = p.outputs["p-ticket"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "not_fetched" and "kv_role" in r["error"]
    r = d.outputs["d-hold"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "not_held" and "kv_role" in r["error"]
    r = d.outputs["d-notheld"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "not_fetched" and "not_held" in r["error"]
    assert not d.worker.fetch_orders and not d.worker.orders
    d.assert_no_leaks()
    # the first hold is still there; a decode fetches it, then both pools are full
    d.add(vh.make_request("d-r", 20, 1, t, seed=2))
    vh.run_both(p, d)
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_abort_while_fetching_frees_the_blocks(vh, engines):
    """A decode request aborted in WAITING_FOR_REMOTE_KVS: vLLM keeps its blocks until finished_recving, which the
    worker reports once the (cancelled or finished) fetch ended; then both pools are full."""
    p, d = _pair(vh, engines, "tcp")
    t = p.prefill("p-ab", 64, seed=8)
    d.add(vh.make_request("d-ab", 64, 2, t, seed=8))
    d.step()  # allocates and orders the fetch; the worker starts it
    assert d.kvxfer.pending() == {"d-ab": "fetch:ordered"}
    d.abort("d-ab")
    r = d.outputs.get("d-ab", {})
    vh.run_both(p, d)
    assert d.finished_recving == {"d-ab": 1}
    assert "d-ab" not in d.first_computed  # never decoded
    assert r == {} or r.get("tokens") == 0
    d.assert_no_leaks()
    p.run()
    p.assert_no_leaks()


def test_unmappable_allocation_still_reports_the_request(vh, engines):
    """If vLLM's allocation does not match the ticket (here: one external token fewer than reported), the request
    waiting for remote KV is still reported in finished_recving, with its blocks as load errors, never left
    waiting forever."""
    p, d = _pair(vh, engines, "tcp", policy="recompute")
    t = p.prefill("p-u", 40, seed=7)
    conn = d.kvxfer
    orig = conn.update_state_after_alloc

    def skewed(request, blocks, n):
        orig(request, blocks, n - 1 if n else n)

    conn.update_state_after_alloc = skewed
    d.add(vh.make_request("d-u", 40, 1, t, seed=7))
    d.run()
    assert d.finished_recving == {"d-u": 1} and d.load_errors
    r = d.outputs["d-u"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "failed" and "internal" in r["error"], r
    assert d.first_computed["d-u"] == 0 and d.outputs["d-u"]["tokens"] == 1
    d.assert_no_leaks()
    p.worker.kvxfer.connector_worker.unregister_kv_caches()
    p.run()
    p.assert_no_leaks()


def test_hold_of_an_aborted_request_is_cancelled_and_freed(vh, engines):
    """A prefill request that decodes on after its prompt (max_tokens > 1) is held from the prompt's step; aborted
    then, its hold is cancelled, vLLM frees the blocks once the worker reported it, and a later fetch of its
    ticket fails (StaleError) and is recomputed on the decode side."""
    p, d = _pair(vh, engines, "tcp", policy="recompute")
    p.add(vh.make_request("p-a", 40, 50, {"kvxfer": {}}, seed=12))
    p.run(until=lambda e: any(o.req_id == "p-a" for o in e.worker.orders) and e.outputs.get("p-a", {}).get("tokens"))
    assert p.worker.kvxfer.pending() == {"p-a": "shipping"}  # held while it decodes on
    p.abort("p-a")
    p.run()
    assert p.finished_sending == {"p-a": 1}
    assert "kv_transfer_params" not in p.outputs["p-a"]  # an aborted request answers nobody
    p.assert_no_leaks()
    assert p.stats.data["hold"]["failures"] == 1
    # a ticket for it (as if a router had it from elsewhere) is stale now
    r = {
        "status": "held",
        "address": p.kvxfer.settings.listen,
        "request_id": "p-a",
        "num_tokens": 40,
        "num_blocks": 3,
        "block_size": BLOCK,
        "lease_expires": time.time() + 30,
    }
    d.add(vh.make_request("d-a", 40, 1, {"kvxfer": r}, seed=12))
    d.run()
    out = d.outputs["d-a"]["kv_transfer_params"]["kvxfer"]
    assert out["status"] == "failed" and out["error"].startswith("StaleError"), out
    assert d.first_computed["d-a"] == 0
    d.assert_no_leaks()


def test_a_ticket_the_decode_cache_already_covers_is_declined_at_once(vh, engines):
    """The decode instance's own prefix cache holds the whole held prompt: it fetches nothing and tells the
    prefill, which frees the held blocks now rather than at the end of the 30 s lease."""
    p, d = _pair(vh, engines, "tcp")
    t1 = p.prefill("p-a", 40, seed=6)
    d.add(vh.make_request("d-a", 40, 2, t1, seed=6))
    vh.run_both(p, d)  # the decode side now caches the first two blocks (32 tokens)
    t2 = p.prefill("p-c", 32, seed=6)  # a hold of exactly those 32 tokens
    d.add(vh.make_request("d-c", 40, 2, t2, seed=6))
    t0 = time.monotonic()
    vh.run_both(p, d)
    assert p.finished_sending.get("p-c") == 1 and time.monotonic() - t0 < 10
    assert d.outputs["d-c"]["kv_transfer_params"]["kvxfer"]["status"] == "not_fetched"
    assert "d-c" not in {o.req_id for o in d.worker.fetch_orders}
    p.assert_no_leaks()
    d.assert_no_leaks()


def _paged_pair(vh, engines, transport, bp, bd, **extra):
    common = {"transport": transport, "deadline": 10, **extra}
    p = engines(vh.kvxfer_ktc(role="kv_producer", listen=f"127.0.0.1:{vh.free_port()}", lease=30, **common), block=bp)
    return p, engines(vh.kvxfer_ktc(role="kv_consumer", **common), block=bd)


@pytest.mark.parametrize(("bp", "bd"), [(16, 32), (32, 16), (16, 64)], ids=["16-into-32", "32-into-16", "16-into-64"])
def test_decode_with_another_block_size_loads_token_for_token(vh, engines, transport, bp, bd):
    """A prefill paging 16 or 32 tokens per block held; a decode instance with another block size fetches into
    the blocks its own scheduler allocated: every prompt slot but the last holds the prefill's bytes, and both
    pools end full. Prompt sizes: 1, a multiple of both block sizes, one more, and a chunked prompt. The prefill
    computes digests (a setting): a fetcher paging differently goes without them."""
    p, d = _paged_pair(vh, engines, transport, bp, bd, digests=True)
    sizes = {"one": 1, "exact": 64, "plus1": 65, "chunked": 150}
    tickets = {name: p.prefill(f"p-{name}", n, seed=i + 1) for i, (name, n) in enumerate(sizes.items())}
    for i, (name, n) in enumerate(sizes.items()):
        assert tickets[name]["kvxfer"]["block_size"] == bp
        d.add(vh.make_request(f"d-{name}", n, 2, tickets[name], seed=i + 1))
    vh.run_both(p, d)
    for i, (name, n) in enumerate(sizes.items()):
        rid = f"d-{name}"
        r = d.outputs[rid]["kv_transfer_params"]["kvxfer"]
        assert r["status"] == "fetched", r
        assert d.first_computed[rid] == n - 1
        assert _loaded_ok(vh, d, rid, n, i + 1, bd) == n - 1
    assert sorted(p.finished_sending) == sorted(f"p-{k}" for k in sizes)
    assert not d.load_errors
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_decode_prefix_hit_with_another_block_size(vh, engines):
    """Decode blocks of 32 over prefill blocks of 16: a local hit of one decode block fetches the held prompt
    from the prefill's third block on. Decode blocks of 16 over prefill blocks of 32: a local hit ending inside
    a prefill block cannot be fetched around, so the rest is computed locally and the hold declined."""
    p, d = _paged_pair(vh, engines, "tcp", 16, 32)
    d.add(vh.make_request("d-a", 40, 2, p.prefill("p-a", 40, seed=5), seed=5))
    vh.run_both(p, d)
    d.add(vh.make_request("d-b", 70, 2, p.prefill("p-b", 70, seed=5), seed=5))
    vh.run_both(p, d)
    o = {o.req_id: o for o in d.worker.fetch_orders}["d-b"]
    assert o.skip == 1 and o.block_ids == d.worker.tables_seen["d-b"][1:3]
    assert d.first_computed["d-b"] == 69 and _loaded_ok(vh, d, "d-b", 70, 5, 32) == 69
    p.assert_no_leaks()
    d.assert_no_leaks()

    p, d = _paged_pair(vh, engines, "tcp", 32, 16)
    d.add(vh.make_request("d-a", 20, 2, p.prefill("p-a", 20, seed=6), seed=6))
    vh.run_both(p, d)
    d.add(vh.make_request("d-b", 70, 2, p.prefill("p-b", 70, seed=6), seed=6))
    vh.run_both(p, d)
    r = d.outputs["d-b"]["kv_transfer_params"]["kvxfer"]
    assert r["status"] == "not_fetched" and "inside one of the prefill's blocks" in r["error"], r
    assert d.first_computed["d-b"] == 16 and d.outputs["d-b"]["tokens"] == 2
    assert "p-b" in p.finished_sending  # declined: freed now, not at the end of the lease
    p.assert_no_leaks()
    d.assert_no_leaks()


def test_an_engine_waiting_only_for_its_fetches_steps_at_a_pace(vh, engines, monkeypatch):
    """vLLM steps an engine whose only request waits for its KV flat out, with nothing to compute (and a TP
    engine's workers with it), starving the processes that move the bytes on a small machine: such a step waits
    ``IDLE_PACE``. The step that orders the fetch does not wait."""
    import socket
    from types import SimpleNamespace

    from kvxfer.integrations.vllm import scheduler

    silent = socket.socket()  # a "prefill" that accepts and never speaks: the fetch stays in flight
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    naps: list[float] = []
    clock = SimpleNamespace(sleep=naps.append, time=time.time, monotonic=time.monotonic)
    monkeypatch.setattr(scheduler, "time", clock)  # the scheduler's own clock only
    d = engines(vh.kvxfer_ktc(role="kv_consumer", transport="tcp", deadline=1))
    ticket = {
        "status": "held",
        "address": f"127.0.0.1:{silent.getsockname()[1]}",
        "request_id": "r",
        "num_tokens": 40,
        "num_blocks": 3,
        "block_size": BLOCK,
        "lease_expires": time.time() + 30,
    }
    try:
        d.add(vh.make_request("d-w", 40, 2, {"kvxfer": ticket}, seed=1))
        d.step()  # allocates and orders the fetch
        assert d.kvxfer.pending() == {"d-w": "fetch:ordered"} and naps == []
        d.step()
        d.step()
        assert naps == [scheduler.IDLE_PACE, scheduler.IDLE_PACE]
    finally:
        silent.close()
