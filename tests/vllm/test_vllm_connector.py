"""KVXferConnector alone, loaded by module path into a real vLLM 0.33 Scheduler, its worker side driven by vLLM's
own KVConnectorModelRunnerMixin over vLLM-allocated CPU KV tensors, shipping real bytes to a real kvxfer Consumer
in another process."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from procs import RemoteError
from vllm_consumer import CacheSpec

pytestmark = pytest.mark.vllm

LOGGER = "vllm.kvxfer"


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


@pytest.fixture
def kvlog():
    h = Records()
    lg = logging.getLogger(LOGGER)
    lg.addHandler(h)
    yield h
    lg.removeHandler(h)


SHIPPING = ("queued", "launching", "shipping")  # a worker shipment that has not ended


def busy_retries(c) -> int:
    """Admissions the consumer answered Busy beyond the first: the retries of the one request it keeps refusing."""
    return max(0, c.stats()["rejected"] - 1)


def _ktc(vh, **extra):
    return vh.kvxfer_ktc(**{"transport": "tcp", "deadline": 10, **extra})


def _check_bytes(vh, e, arrival, *, whole_blocks: bool) -> int:
    """Every prompt slot holds what the fake attention wrote; with whole_blocks, every byte of every block equals
    the producer's block when shipped (vLLM may reuse the blocks of a request that ended)."""
    rid = arrival["meta"]["vllm_request_id"]
    n = vh.expected_tokens_ok(arrival, e.prompts[rid], e.worker.block)
    if whole_blocks:
        assert len(arrival["blocks"]) == len(e.worker.shipped[rid])
        for i, (got, sent) in enumerate(zip(arrival["blocks"], e.worker.shipped[rid], strict=True)):
            assert got == sent, (rid, i)
    return n


def test_batch_of_claimed_and_unclaimed_chunked_and_prefix_hit(vh, engines, consumers):
    c = consumers(spec=CacheSpec(num_blocks=64))
    e = engines(_ktc(vh, digests=True), max_batched=64)
    claim = {"kvxfer": {"consumer": c.address, "meta": {"route": "tilert-0"}}}
    e.add(vh.make_request("kvx-long", 150, 1, claim, seed=1))  # chunked: 64 + 64 + 22 tokens
    e.add(vh.make_request("plain", 20, 3, None, seed=2))  # no kv_transfer_params at all
    e.add(vh.make_request("other", 40, 2, {"do_remote_decode": False}, seed=3))  # someone else's params
    e.add(vh.make_request("kvx-decodes", 30, 4, {"kvxfer": {"consumer": c.address}}, seed=4))
    e.run()
    # the same prompt again: a local prefix-cache hit, whose cached blocks must be shipped too
    e.add(vh.make_request("kvx-prefix", 150, 1, {"kvxfer": {"consumer": c.address, "request_id": "dec-7"}}, seed=1))
    e.run()

    assert e.outputs["plain"]["kv_transfer_params"] is None
    assert e.outputs["other"]["kv_transfer_params"] is None
    assert e.outputs["plain"]["tokens"] == 3 and e.outputs["other"]["tokens"] == 2
    p = e.outputs["kvx-long"]["kv_transfer_params"]
    assert list(p) == ["kvxfer"]  # everything under the one key
    assert p["kvxfer"]["request_id"] == "kvx-long" and p["kvxfer"]["consumer"] == c.address
    assert p["kvxfer"]["num_tokens"] == 150 and p["kvxfer"]["num_blocks"] == 10
    assert e.outputs["kvx-prefix"]["kv_transfer_params"]["kvxfer"]["request_id"] == "dec-7"
    assert e.outputs["kvx-decodes"]["tokens"] == 4

    # one order per claimed request, none for the others; the chunked one only once its prompt was computed
    assert sorted(o.req_id for o in e.worker.orders) == ["kvx-decodes", "kvx-long", "kvx-prefix"]
    assert e.first_computed["kvx-prefix"] >= 144, "expected a prefix-cache hit"

    arrivals = {a["req"]: a for a in (c.get(10) for _ in range(3))}
    assert sorted(arrivals) == ["dec-7", "kvx-decodes", "kvx-long"]
    assert _check_bytes(vh, e, arrivals["kvx-long"], whole_blocks=True) == 150
    assert _check_bytes(vh, e, arrivals["dec-7"], whole_blocks=True) == 150
    assert _check_bytes(vh, e, arrivals["kvx-decodes"], whole_blocks=False) == 30
    assert arrivals["kvx-long"]["digests"] == 4 * 10 and arrivals["dec-7"]["digests"] == 4 * 10  # CRC per block
    assert arrivals["kvx-long"]["meta"] == {
        "route": "tilert-0",
        "num_tokens": 150,
        "block_size": 16,
        "vllm_request_id": "kvx-long",
    }
    assert arrivals["dec-7"]["meta"]["vllm_request_id"] == "kvx-prefix"
    # prefix blocks are shared: the hit shipped the very blocks kvx-long computed
    orders = {o.req_id: o for o in e.worker.orders}
    assert orders["kvx-prefix"].block_ids[:9] == orders["kvx-long"].block_ids[:9]
    e.assert_no_leaks()
    assert set(e.finished_sending) <= {"kvx-long", "kvx-decodes", "kvx-prefix"}
    s = c.stats()
    assert s["completed"] == 3 and s["failed"] == 0


def test_unclaimed_requests_are_a_complete_no_op(vh, engines):
    e = engines(_ktc(vh))
    calls = []
    sched_conn = e.kvxfer
    orig = sched_conn.update_state_after_alloc

    def spy(request, blocks, n):
        orig(request, blocks, n)
        calls.append((request.request_id, sched_conn.pending()))

    sched_conn.update_state_after_alloc = spy
    for i in range(4):
        e.add(vh.make_request(f"r{i}", 40 + i, 3, None if i % 2 else {"foo": {"consumer": "x:1"}}, seed=i))
    e.run()
    assert len(calls) == 4 and all(not tracked for _, tracked in calls)
    assert not e.worker.orders and not e.finished_sending
    assert all(o["kv_transfer_params"] is None for o in e.outputs.values())
    r = vh.make_request("probe", 10, 1, None)
    assert sched_conn.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched_conn.request_finished(r, [1, 2]) == (False, None)
    e.assert_no_leaks()


def test_malformed_claims_ship_nothing_and_say_why(vh, engines):
    e = engines(_ktc(vh, allowed_consumers=["127.0.0.1"]))
    e.add(vh.make_request("no-consumer", 20, 1, {"kvxfer": {}}))
    e.add(vh.make_request("not-a-dict", 20, 1, {"kvxfer": "127.0.0.1:1"}))
    e.add(vh.make_request("bad-address", 20, 1, {"kvxfer": {"consumer": "nowhere"}}))
    e.add(vh.make_request("not-allowed", 20, 1, {"kvxfer": {"consumer": "10.9.9.9:5000"}}))
    e.run()
    for rid in ("not-a-dict", "bad-address", "not-allowed"):
        p = e.outputs[rid]["kv_transfer_params"]["kvxfer"]
        assert p["status"] == "not_sent" and "error" in p, (rid, p)
    # no consumer named: a hold, which needs the "listen" setting this instance lacks
    p = e.outputs["no-consumer"]["kv_transfer_params"]["kvxfer"]
    assert p["status"] == "not_held" and "listen" in p["error"] and "address" not in p, p
    assert "allowed_consumers" in e.outputs["not-allowed"]["kv_transfer_params"]["kvxfer"]["error"]
    assert not e.worker.orders and not e.finished_sending
    e.assert_no_leaks()


def test_consumer_busy_is_retried_until_admitted(vh, engines, consumers, kvlog):
    c = consumers(spec=CacheSpec(num_blocks=6))  # room for one 4-block request at a time
    e = engines(_ktc(vh, digests=True))
    e.add(vh.make_request("A", 64, 1, {"kvxfer": {"consumer": c.address}}, seed=11))
    e.run()
    held = c.get(10, release=False)  # the decode runtime keeps A's blocks: the consumer is full
    assert held["req"] == "A"
    e.add(vh.make_request("B", 64, 1, {"kvxfer": {"consumer": c.address}}, seed=12))
    seen = {"retries": 0, "released": False}

    def on_step(eng):
        seen["retries"] = max(seen["retries"], busy_retries(c))
        if seen["retries"] >= 2 and not seen["released"]:
            c.release("A")
            seen["released"] = True

    e.run(on_step=on_step)
    assert seen["released"] and seen["retries"] >= 2
    b = c.get(10)
    assert b["req"] == "B" and _check_bytes(vh, e, b, whole_blocks=True) == 64
    assert e.finished_sending == {"A": 1, "B": 1}
    e.assert_no_leaks()
    assert c.stats()["rejected"] >= 2
    assert "failed" not in kvlog.text()


@pytest.mark.parametrize("retry_busy", [True, False], ids=["retry", "no-retry"])
def test_consumer_busy_past_the_deadline_fails_and_frees(vh, engines, consumers, kvlog, retry_busy):
    c = consumers(spec=CacheSpec(num_blocks=3))  # 4 blocks never fit: always Busy
    deadline = 1.0 if retry_busy else 5.0
    e = engines(_ktc(vh, deadline=deadline, retry_busy=retry_busy))
    # One block fits: the session is up before "big", so its deadline is spent on Busy answers, not on a handshake
    # (a loaded machine can take most of a second to connect).
    e.add(vh.make_request("warm", 10, 1, {"kvxfer": {"consumer": c.address}}, seed=20))
    e.run(timeout=15)
    assert c.get(10)["req"] == "warm"
    e.add(vh.make_request("big", 64, 1, {"kvxfer": {"consumer": c.address}}, seed=21))
    took = e.run(timeout=15)
    assert e.outputs["big"]["kv_transfer_params"]["kvxfer"]["status"] == "sending"  # held at finish
    assert e.finished_sending == {"warm": 1, "big": 1}
    if retry_busy:
        assert deadline - 0.1 <= took < deadline + 4, took  # retried until the deadline, then released
    else:
        assert took < deadline / 2, took  # the first Busy ends it
    e.assert_no_leaks()
    text = kvlog.text()
    assert "request big" in text and "failed" in text and ("busy" in text.lower())


def test_abort_while_shipping_and_mid_prefill(vh, engines, consumers):
    c = consumers(spec=CacheSpec(num_blocks=6))
    e = engines(_ktc(vh), max_batched=64)
    e.add(vh.make_request("A", 64, 1, {"kvxfer": {"consumer": c.address}}, seed=31))
    e.run()
    c.get(10, release=False)  # consumer full: B's shipment keeps retrying Busy
    e.add(vh.make_request("B", 64, 500, {"kvxfer": {"consumer": c.address}}, seed=32))  # decodes on
    e.add(vh.make_request("C", 200, 1, {"kvxfer": {"consumer": c.address}}, seed=33))  # chunked prefill
    state = {}

    def on_step(eng):
        if "B" not in state and busy_retries(c) >= 1:
            eng.abort("B")  # mid-transfer: the request holds its blocks until the worker reports it
            state["B"] = time.monotonic()
        r = eng.sched.requests.get("C")
        if "C" not in state and r is not None and 0 < r.num_computed_tokens < 200:
            eng.abort("C")  # mid chunked prefill: nothing was ordered, nothing is held
            state["C"] = time.monotonic()

    e.run(on_step=on_step)
    assert "B" in state and "C" in state
    assert e.finished_sending == {"A": 1, "B": 1}
    assert "B" not in e.outputs or "kv_transfer_params" not in e.outputs["B"]  # aborted: no final output
    assert [o.req_id for o in e.worker.orders] == ["A", "B"]
    e.assert_no_leaks()
    c.release("A")
    with pytest.raises(RemoteError, match="DeadlineError: no arrival"):
        c.get(0.5)
    s = c.stats()
    assert s["completed"] == 1 and s["inflight"] == 0


def test_consumer_dead_fails_fast_and_next_consumer_works(vh, engines, consumers, kvlog):
    dead = consumers(spec=CacheSpec())
    address = dead.address
    dead.kill()
    e = engines(_ktc(vh))
    e.add(vh.make_request("to-dead", 40, 1, {"kvxfer": {"consumer": address}}, seed=41))
    took = e.run(timeout=10)
    assert took < 5.0, took  # refused at once, not held until the 10 s deadline
    assert e.finished_sending == {"to-dead": 1}
    assert "request to-dead" in kvlog.text() and "PeerError" in kvlog.text()
    live = consumers(spec=CacheSpec())
    e.add(vh.make_request("to-live", 40, 1, {"kvxfer": {"consumer": live.address}}, seed=42))
    e.run(timeout=10)
    a = live.get(10)
    assert a["req"] == "to-live" and _check_bytes(vh, e, a, whole_blocks=True) == 40
    e.assert_no_leaks()


def test_consumer_hung_before_and_after_handshake_hits_the_deadline(vh, engines, consumers, kvlog):
    c = consumers(spec=CacheSpec())
    e = engines(_ktc(vh, deadline=3.0, connect_timeout=0.5))
    e.add(vh.make_request("warm", 40, 1, {"kvxfer": {"consumer": c.address}}, seed=51))
    e.run()
    assert c.get(10)["req"] == "warm"
    c.stop()  # SIGSTOP: the established session's consumer answers nothing any more
    e.add(vh.make_request("hung", 40, 1, {"kvxfer": {"consumer": c.address}}, seed=52))
    took = e.run(timeout=15)
    assert 2.9 <= took < 7.0, took  # the admission goes unanswered: the deadline ends it
    assert e.finished_sending == {"warm": 1, "hung": 1}
    assert "request hung" in kvlog.text() and "DeadlineError" in kvlog.text()
    e.assert_no_leaks()
    fresh = consumers(spec=CacheSpec())
    fresh.stop()  # a consumer that accepts the connection but never completes the handshake
    e.add(vh.make_request("hung2", 40, 1, {"kvxfer": {"consumer": fresh.address}}, seed=53))
    took = e.run(timeout=15)
    assert took < 2.5, took  # connect_timeout (0.5 s) bounds the handshake, well inside the 3 s deadline
    assert e.finished_sending["hung2"] == 1
    line = next(x for x in kvlog.text().splitlines() if "request hung2" in x)
    assert f"handshake with {fresh.address} not done within 0.5s" in line, line  # says where the time went
    e.assert_no_leaks()


def test_preempted_mid_transfer_is_cancelled_and_leaks_nothing(vh, engines, consumers):
    c = consumers(spec=CacheSpec(), deadline=1.0)
    # 10 usable blocks of 16 tokens: two 64-token prompts decoding 80 tokens each cannot both fit
    # inline_max=0: A's bytes wait for its grant (an inline push would carry them in its Admit, and a consumer
    # resumed after the preemption would land them before reading the Cancel: the cancel lost that race)
    e = engines(_ktc(vh, deadline=20, inline_max=0), num_blocks=11, max_batched=128)
    e.add(vh.make_request("warm", 16, 1, {"kvxfer": {"consumer": c.address}}, seed=60))
    e.run()
    c.get(10)
    c.stop()  # A's shipment stays pending at admission while A decodes on
    e.add(vh.make_request("B", 64, 80, None, seed=61))
    e.add(vh.make_request("A", 64, 80, {"kvxfer": {"consumer": c.address}}, seed=62))
    e.run(timeout=20)
    assert "A" in e.preempted, "the scenario must preempt A"
    c.cont()
    assert e.outputs["A"]["tokens"] == 80 and e.outputs["B"]["tokens"] == 80
    p = e.outputs["A"]["kv_transfer_params"]["kvxfer"]
    assert p["status"] == "cancelled" and "preempted" in p["error"]
    assert [o.req_id for o in e.worker.orders] == ["warm", "A"]  # shipped once, never again after resuming
    e.assert_no_leaks()
    with pytest.raises(RemoteError, match="DeadlineError: no arrival"):
        c.get(0.3)
    deadline = time.monotonic() + 5
    while c.stats()["inflight"] and time.monotonic() < deadline:  # the consumer's own deadline frees its grant
        time.sleep(0.05)
    assert c.stats()["inflight"] == 0


def test_transfer_ended_before_finish_frees_without_holding(vh, engines, consumers):
    """A claimed request that decodes on: once the worker reported its transfer ended, request_finished no longer
    holds the blocks, and the worker never reports it in finished_sending."""
    c = consumers(spec=CacheSpec())
    e = engines(_ktc(vh))
    e.add(vh.make_request("long-decode", 40, 12, {"kvxfer": {"consumer": c.address}}, seed=91))

    def on_step(eng):  # hold the engine until the shipment ended (a slow model, as it were)
        end = time.monotonic() + 10
        while eng.worker.kvxfer.pending().get("long-decode") in SHIPPING and time.monotonic() < end:
            time.sleep(0.005)

    e.run(on_step=on_step)
    p = e.outputs["long-decode"]["kv_transfer_params"]["kvxfer"]
    assert p["status"] == "done" and e.outputs["long-decode"]["tokens"] == 12
    assert e.finished_sending == {}
    a = c.get(10)
    assert a["req"] == "long-decode" and vh.expected_tokens_ok(a, e.prompts["long-decode"], 16) == 40
    e.assert_no_leaks()


def test_no_thread_waits_per_request_in_flight(vh, engines, consumers):
    """Shipments pending at a stopped (SIGSTOP) consumer hold no thread each: the process has as many live threads
    with 25 requests in flight as with one (each push's end arrives by callback); all of them land once it resumes."""
    c = consumers(spec=CacheSpec(num_blocks=64))
    e = engines(_ktc(vh, deadline=20), num_blocks=128)
    e.add(vh.make_request("warm", 20, 1, {"kvxfer": {"consumer": c.address}}, seed=110))
    e.run()
    assert c.get(10)["req"] == "warm"
    c.stop()  # the session stays up; every admission from now on goes unanswered

    def shipping(n):
        return lambda eng: sum(s == "shipping" for s in eng.worker.kvxfer.pending().values()) >= n

    e.add(vh.make_request("r0", 20, 1, {"kvxfer": {"consumer": c.address}}, seed=111))
    e.run(timeout=10, until=shipping(1))
    before = threading.enumerate()
    for i in range(1, 25):
        e.add(vh.make_request(f"r{i}", 20, 1, {"kvxfer": {"consumer": c.address}}, seed=111 + i))
    e.run(timeout=10, until=shipping(25))
    after = threading.enumerate()
    assert len(after) <= len(before), sorted(t.name for t in set(after) - set(before))
    c.cont()
    e.run(timeout=20)
    assert sorted(c.get(10)["req"] for _ in range(25)) == sorted(f"r{i}" for i in range(25))
    assert e.finished_sending == {"warm": 1, **{f"r{i}": 1 for i in range(25)}}
    e.assert_no_leaks()


def test_a_hung_handshake_delays_no_other_shipment(vh, engines, consumers, kvlog):
    """A consumer that accepts the connection and never answers the handshake holds up nothing else: the push to
    it returns at once (its handshake runs on the producer's pool), a request to a live consumer ordered after it
    ships within its own short deadline, and the hung one is reported by its deadline."""
    hung = consumers(spec=CacheSpec())
    hung.stop()  # accepts the connection, never completes the handshake
    live = consumers(spec=CacheSpec())
    # the hung one's 6 s against the other's 2 s leave room for a machine busy starting vLLM servers beside this
    e = engines(_ktc(vh, deadline=6.0, connect_timeout=6.0, ship_threads=1))
    e.add(vh.make_request("to-hung", 40, 1, {"kvxfer": {"consumer": hung.address}}, seed=121))
    e.run(timeout=10, until=lambda eng: eng.worker.kvxfer.pending().get("to-hung") == "shipping")
    t0 = time.monotonic()
    e.add(vh.make_request("after", 40, 1, {"kvxfer": {"consumer": live.address, "deadline": 2.0}}, seed=122))
    e.run(timeout=10, until=lambda eng: "after" in eng.finished_sending)
    took = time.monotonic() - t0
    assert took < 4.0, took  # the hung handshake (up to 6 s) is still going on
    assert e.worker.kvxfer.pending().get("to-hung") == "shipping"
    assert live.get(10)["req"] == "after"
    e.run(timeout=15)
    assert e.finished_sending == {"to-hung": 1, "after": 1}
    assert "request to-hung" in kvlog.text()
    e.assert_no_leaks()


@pytest.mark.parametrize("block", [64, 32], ids=["into-64", "into-32"])
def test_push_into_a_consumer_with_another_block_size(vh, engines, consumers, block):
    """The prefill pages 16 tokens per block; a decode runtime pages ``block``: it is granted the blocks that hold
    the prompt (no more) and every prompt token lands in its slot."""
    c = consumers(spec=CacheSpec(num_blocks=16, block_size=block))
    e = engines(_ktc(vh))
    for rid, n in (("short", 20), ("long", 150)):
        e.add(vh.make_request(rid, n, 1, {"kvxfer": {"consumer": c.address, "request_id": rid}}, seed=n))
    e.run(timeout=20)
    got = {a["req"]: a for a in (c.get(10), c.get(10))}
    for rid, n in (("short", 20), ("long", 150)):
        assert len(got[rid]["blocks"]) == -(-n // block)
        assert vh.expected_tokens_ok(got[rid], e.prompts[rid], block) == n
    e.assert_no_leaks()
