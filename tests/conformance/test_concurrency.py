"""Several producer processes and many requests in flight into one consumer: every byte still right."""

import threading

import numpy as np

from kvxfer import Producer
from procs import TRANSPORT_ONLY

from .conftest import SENTINEL
from .kvspec import Spec, block_bytes, untouched
from .peers import wait_for

SPEC = Spec(kind="nhd", num_blocks=512, layers=2, heads=2, block_size=4, head_dim=16)


def test_several_producer_processes(consumers, producers):
    consumer = consumers(SPEC)
    procs = [producers(SPEC, seed=100 + i) for i in range(3)]
    rng = np.random.default_rng(1)
    plans = {}
    for i, p in enumerate(procs):
        for r in range(6):
            ids = rng.permutation(SPEC.num_blocks)[: int(rng.integers(1, 24))]
            req = f"p{i}-r{r}"
            plans[req] = (i, ids)
            (p.push if r % 2 else p.offer)(consumer.address, req, ids, wait=False)
    arrivals = {}
    while len(arrivals) < len(plans):
        a = consumer.get(20)
        arrivals[a.req] = a
    sources = {i: SPEC.build(seed=100 + i)[2] for i in range(3)}
    for req, (i, ids) in plans.items():
        a = arrivals[req]
        for s, d in zip(block_bytes(sources[i], ids), block_bytes(consumer.views, a.block_ids), strict=True):
            np.testing.assert_array_equal(s, d)
    held = np.concatenate([a.block_ids for a in arrivals.values()])
    assert len(np.unique(held)) == len(held)
    assert untouched(consumer.views, held, SENTINEL)
    for req in plans:
        assert consumer.release(req)
    assert consumer.stats()["free_blocks"] == SPEC.num_blocks


def test_many_requests_in_flight_from_threads(consumers, transport):
    consumer = consumers(SPEC)
    tensors, kw, views, _ = SPEC.build(seed=7)
    producer = Producer(SPEC.layout(tensors, kw), transport=transport, **TRANSPORT_ONLY)
    rng = np.random.default_rng(2)
    jobs = {f"t{i}": rng.permutation(SPEC.num_blocks)[:8] for i in range(48)}
    transfers = {}
    lock = threading.Lock()

    def submit(names):
        for name in names:
            mode = producer.push if int(name[1:]) % 3 else producer.offer
            t = mode(consumer.address, name, jobs[name])
            with lock:
                transfers[name] = t

    names = sorted(jobs)
    threads = [threading.Thread(target=submit, args=(names[k::4],)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        for t in transfers.values():
            t.wait(30)
        got = {}
        while len(got) < len(jobs):
            a = consumer.get(10)
            got[a.req] = a
        for name, ids in jobs.items():
            for s, d in zip(block_bytes(views, ids), block_bytes(consumer.views, got[name].block_ids), strict=True):
                np.testing.assert_array_equal(s, d)
            consumer.release(name)
        wait_for(lambda: consumer.stats()["free_blocks"] == SPEC.num_blocks, 5)
    finally:
        producer.close()


def _lands(send, c, address, req, ids, sources) -> None:
    """``send`` (a producer process's push or offer) moves blocks ``ids`` to consumer ``c`` at ``address``: the
    arrival holds the source's bytes, and its blocks go back."""
    send(address, req, ids)  # raises (RemoteError) when it failed
    a = c.get(10)
    assert a.req == req
    for s, d in zip(block_bytes(sources, ids), block_bytes(c.views, a.block_ids), strict=True):
        np.testing.assert_array_equal(s, d)
    assert c.release(req)


def test_a_consumer_leaving_takes_no_other_consumers_link(consumers, producers):
    """Consumers number their sessions each from 1, so one producer's sessions to two consumers carry the same
    number. The first consumer closing must end its own session's link only: the other's transfers, over the data
    path (nothing inline), go on (a producer that kept links by that number closed the wrong one)."""
    spec = Spec(kind="nhd", num_blocks=64, layers=2, heads=2, block_size=4, head_dim=16)
    first, second = consumers(spec), consumers(spec)
    p = producers(spec, seed=4, inline_max=0)
    rng = np.random.default_rng(3)
    sources = spec.build(seed=4)[2]

    def moved(c, req, kind):
        _lands(p.push if kind == "push" else p.offer, c, c.address, req, rng.permutation(spec.num_blocks)[:6], sources)

    moved(first, "first-0", "push")
    moved(second, "second-0", "push")  # the second session, numbered as the first was
    assert p.call("sessions") == 2
    first.c.close()
    assert wait_for(lambda: p.call("sessions") == 1, 10)  # the producer saw the first session end
    for i in range(3):
        moved(second, f"second-push-{i}", "push")
        moved(second, f"second-pull-{i}", "offer")
    assert second.stats()["free_blocks"] == spec.num_blocks


def test_one_producer_at_two_addresses_of_a_consumer_moves_on_both_sessions(consumers, producers):
    """A producer that reaches one consumer by two addresses (an IP and a name for it) has two sessions with it,
    over one pair of transport endpoints. Requests on each, alternating, all land (over nixl the notifications
    of the first session's writes were counted for the second: its pushes failed at their deadline)."""
    spec = Spec(kind="nhd", num_blocks=64, layers=2, heads=2, block_size=4, head_dim=16)
    c = consumers(spec, deadline=5.0)
    p = producers(spec, seed=6, inline_max=0)
    port = c.address.rsplit(":", 1)[1]
    rng = np.random.default_rng(4)
    sources = spec.build(seed=6)[2]
    for i in range(6):
        address = f"127.0.0.1:{port}" if i % 2 == 0 else f"localhost:{port}"
        _lands(p.push if i % 3 else p.offer, c, address, f"two-{i}", rng.permutation(spec.num_blocks)[:6], sources)
    assert p.call("sessions") == 2
    assert c.stats()["free_blocks"] == spec.num_blocks
