"""Faults end in a typed error within the deadline, never a hang, and leak no block, grant or lease."""

import itertools
import threading
import time

import numpy as np
import pytest

from kvxfer import (
    BusyError,
    CancelledError,
    ClosedError,
    DeadlineError,
    LeaseExpiredError,
    PeerError,
    Producer,
    Status,
    TransportError,
    wire,
)
from procs import TRANSPORT_ONLY

from .conftest import PARALLEL
from .kvspec import Spec
from .peers import PeerError as RemoteError
from .peers import wait_for

BIG = Spec(kind="nhd", num_blocks=256, layers=4, heads=8, block_size=16, head_dim=128, dtype="float16")  # 128 MiB


def _settled(consumer, free: int) -> bool:
    s = consumer.stats()
    return s["free_blocks"] == free and s["inflight"] == 0 and s["dying"] == 0


def _interrupt_midway(consumer, start, interrupt, resume=lambda: None) -> None:
    """``start(attempt)`` a transfer of the consumer's, ``interrupt()`` its producer once the consumer admitted
    it, and wait until the consumer settled (``resume()`` after). On a loaded machine 100 MiB over shared memory
    can land before this process sees the transfer start: a round whose transfer beat the interrupt proves
    nothing, its blocks go back, and it runs again (five rounds at most)."""
    for attempt in range(5):
        start(attempt)
        wait_for(lambda: consumer.stats()["inflight"] == 1 or not consumer.arrivals.empty(), 10, 0.001)
        interrupt()
        try:
            wait_for(lambda: _settled(consumer, 256) or not consumer.arrivals.empty(), 10)
        finally:
            resume()
        if consumer.arrivals.empty():
            return
        consumer.release(consumer.get(timeout=1).req)
        wait_for(lambda: _settled(consumer, 256), 10)
    pytest.fail("every transfer was done before its producer was interrupted")


def _local_producer(spec, transport, **options):
    tensors, kw, _, raw = spec.build(seed=1)
    return Producer(spec.layout(tensors, kw), transport=transport, **{**TRANSPORT_ONLY, **options}), raw


# A transfer as one piece (sequential blocks) or as parallel pieces (scattered blocks, TCP windows and NIXL lanes
# forced on): when a peer dies every piece ends, the blocks go back, nothing is handed off.
PIECES = {
    "one": ({}, lambda n: np.arange(n)),
    "parallel": (PARALLEL, lambda n: np.random.default_rng(5).permutation(256)[:n]),
}


@pytest.mark.parametrize("mode,pieces", [("push", "one"), ("push", "parallel"), ("pull", "parallel")])
def test_producer_killed_mid_transfer(consumers, producers, mode, pieces):
    options, ids = PIECES[pieces]
    consumer = consumers(BIG, transport_options=options)
    made = []  # a new producer each round: the last one is killed

    def start(attempt: int) -> None:
        made.append(producers(BIG, transport_options=options))
        getattr(made[-1], mode)(consumer.address, f"doomed-{attempt}", ids(200), wait=False)

    _interrupt_midway(consumer, start, lambda: made[-1].kill())
    assert consumer.arrivals.empty()
    assert consumer.stats()["failed"] == 1


@pytest.mark.parametrize("pieces", ["one", "parallel"])
def test_consumer_killed_mid_transfer(remote_consumers, transport, pieces):
    options, ids = PIECES[pieces]
    consumer = remote_consumers(BIG, transport_options=options)
    producer, _ = _local_producer(BIG, transport, deadline=20, transport_options=options)
    try:
        t = producer.push(consumer.address, "orphan", ids(256))
        wait_for(lambda: t.status in (Status.MOVING, Status.COMMITTING) or t.done(), 10, 0.001)
        consumer.stop()
        consumer.kill()
        start = time.monotonic()
        with pytest.raises((PeerError, DeadlineError, TransportError)):
            t.wait()
        assert time.monotonic() - start < 20
        assert t.status is Status.FAILED
        assert not any(s.transfers for s in producer._sessions.values())
    finally:
        producer.close()


def test_consumer_stopped_hits_the_deadline(remote_consumers, transport):
    consumer = remote_consumers(BIG)
    producer, _ = _local_producer(BIG, transport)
    try:
        producer.push(consumer.address, "warm", [0]).wait(10)
        consumer.stop()
        start = time.monotonic()
        t = producer.push(consumer.address, "stuck", np.arange(1, 256), deadline=1.0)
        with pytest.raises(DeadlineError):
            t.wait()
        assert time.monotonic() - start < 3.0
        assert not any(s.transfers for s in producer._sessions.values())
    finally:
        consumer.cont()
        producer.close()


SMALL = Spec(kind="nhd", num_blocks=64, layers=4, heads=2, block_size=16, head_dim=64, dtype="float16")  # 32 KiB


def test_a_consumer_that_stops_reading_blocks_no_caller_and_no_deadline(remote_consumers, transport):
    """Small pushes carry their bytes in their control messages: a stopped consumer's socket buffers fill after a
    few hundred. A send then waits for room only so long (``channel.SEND_STALL``) before the session counts as
    lost: the caller gets its push back, and every transfer ends, none left waiting on a peer that reads nothing."""
    from kvxfer.channel import SEND_STALL

    consumer = remote_consumers(SMALL)
    producer, _ = _local_producer(SMALL, transport, inline_max=64 << 10)  # the default: these pushes go inline
    pushes: list = []
    try:
        producer.push(consumer.address, "warm", [0]).wait(10)
        consumer.stop()
        start = time.monotonic()

        def submit() -> None:
            for i in range(400):
                pushes.append(producer.push(consumer.address, f"r{i}", [i % 64], deadline=1.0))

        pusher = threading.Thread(target=submit, daemon=True)
        pusher.start()
        pusher.join(SEND_STALL + 10)
        assert not pusher.is_alive(), f"push() blocked its caller: {len(pushes)} of 400 submitted"
        assert wait_for(lambda: all(t.done() for t in pushes), 10)
        assert time.monotonic() - start < SEND_STALL + 10
        assert all(isinstance(t.error, (DeadlineError, PeerError)) for t in pushes), {type(t.error) for t in pushes}
    finally:
        consumer.cont()
        producer.close()


def test_producer_stopped_hits_the_consumer_deadline(consumers, producers):
    consumer = consumers(BIG, deadline=1.0)
    producer = producers(BIG)
    producer.push(consumer.address, "warm", [0])
    consumer.release(consumer.get(10).req)
    _interrupt_midway(
        consumer,
        lambda attempt: producer.push(consumer.address, f"frozen-{attempt}", np.arange(256), wait=False),
        producer.stop,
        producer.cont,
    )
    assert consumer.stats()["failed"] >= 1


def test_producer_cancels(consumers, transport):
    consumer = consumers(BIG)
    producer, _ = _local_producer(BIG, transport)
    try:
        # On a loaded machine 128 MiB in one process can land before this thread runs again: a round whose push
        # was done before the cancel proves nothing, its blocks go back, and it runs again (five rounds at most).
        for attempt in range(5):
            req = f"c-{attempt}"
            t = producer.push(consumer.address, req, np.arange(256))
            wait_for(lambda t=t: t.status is not Status.PENDING, 10, 0.0005)
            t.cancel("changed my mind")
            if t.status is not Status.DONE:
                break
            consumer.release(consumer.get(timeout=5).req)
            wait_for(lambda: _settled(consumer, 256), 10)
        else:
            pytest.fail("every push was done before it was cancelled")
        assert t.status is Status.CANCELLED
        with pytest.raises(CancelledError):
            t.wait(5)
        wait_for(lambda: _settled(consumer, 256), 10)
        # the same request id is refused while its tombstone lasts
        with pytest.raises(CancelledError):
            producer.push(consumer.address, req, [1]).wait(5)
        producer.push(consumer.address, "fresh", [1]).wait(5)
    finally:
        producer.close()


def test_consumer_cancels(consumers, transport):
    consumer = consumers(BIG)
    producer, _ = _local_producer(BIG, transport)
    try:
        t = producer.push(consumer.address, "victim", np.arange(256))
        wait_for(lambda: consumer.stats()["inflight"] == 1, 10, 0.0005)
        consumer.cancel("victim", "decode node draining")
        with pytest.raises((CancelledError, PeerError)):
            t.wait(10)
        wait_for(lambda: _settled(consumer, 256), 10)
    finally:
        producer.close()


def test_lease_expires(remote_consumers, transport):
    consumer = remote_consumers(Spec())
    producer, _ = _local_producer(Spec(), transport)
    try:
        producer.push(consumer.address, "warm", [0]).wait(10)
        consumer.stop()
        t = producer.offer(consumer.address, "lease", [1, 2, 3], lease=0.5)
        start = time.monotonic()
        with pytest.raises(LeaseExpiredError):
            t.wait()
        assert time.monotonic() - start < 2.0
        assert not producer.leases.active
    finally:
        consumer.cont()
        producer.close()


def test_busy_then_retry(consumers, producers):
    consumer = consumers(Spec(num_blocks=64))
    producer = producers(Spec(num_blocks=64))
    producer.push(consumer.address, "a", np.arange(40))
    first = consumer.get(10)
    with pytest.raises(RemoteError) as e:
        producer.push(consumer.address, "b", np.arange(40))
    assert e.value.kind == "BusyError"
    consumer.release(first.req)
    producer.push(consumer.address, "b", np.arange(40))
    consumer.release(consumer.get(10).req)
    assert _settled(consumer, 64)


def test_busy_carries_retry_after(consumers, transport):
    consumer = consumers(Spec(num_blocks=8), retry_after=0.25)
    producer, _ = _local_producer(Spec(num_blocks=8), transport)
    try:
        with pytest.raises(BusyError) as e:
            producer.push(consumer.address, "x", np.arange(8)).wait(5)
            producer.push(consumer.address, "y", np.arange(8)).wait(5)
        assert e.value.retry_after == pytest.approx(0.25, abs=0.01)
    finally:
        producer.close()


def test_pull_bytes_stay_put_when_the_lease_is_cancelled(consumers, transport):
    consumer = consumers(BIG)
    producer, _ = _local_producer(BIG, transport)
    try:
        t = producer.offer(consumer.address, "gone", np.arange(256), lease=10)
        t.cancel()
        wait_for(lambda: _settled(consumer, 256) or consumer.stats()["handed"] == 1, 10)
        s = consumer.stats()
        if s["handed"]:  # the read finished before the cancel arrived: the producer refused it
            pytest.fail("a cancelled offer must not be handed to the runtime")
        assert not producer.leases.active
    finally:
        producer.close()


def test_close_ends_everything(consumers, transport):
    consumer = consumers(BIG)
    producer, _ = _local_producer(BIG, transport)
    t = producer.push(consumer.address, "late", np.arange(256))
    producer.close()
    with pytest.raises(ClosedError):
        t.wait(5)
    assert t.done()
    wait_for(lambda: _settled(consumer, 256), 10)
    assert consumer.arrivals.empty()


@pytest.mark.parametrize("behind", ["handshake", "worker"])
def test_a_queued_push_ends_at_its_own_deadline(transport, behind):
    """A consumer that accepts and never answers keeps a first push handshaking (a long connect timeout). A second
    push with a short deadline, queued behind that handshake (to the same consumer) or behind the producer's only
    worker, busy with it (to another such consumer), still ends at its own deadline."""
    import socket

    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    first, other = (f"127.0.0.1:{s.getsockname()[1]}" for s in silent)
    options = {"workers": 1} if behind == "worker" else {}
    producer, _ = _local_producer(Spec(num_blocks=8), transport, connect_timeout=5.0, **options)
    try:
        slow = producer.push(first, "first", [0], deadline=4.0)
        time.sleep(0.2)  # the first push is handshaking
        start = time.monotonic()
        quick = producer.push(first if behind == "handshake" else other, "second", [1], deadline=0.5)
        with pytest.raises(DeadlineError):
            quick.wait(3.0)
        assert time.monotonic() - start < 1.5, f"the queued push waited for the {behind}"
        with pytest.raises(DeadlineError):
            slow.wait(6.0)
    finally:
        producer.close()
        for s in silent:
            s.close()


@pytest.mark.parametrize("kind", ["admit", "offer"])
def test_a_request_read_just_before_the_consumer_closed_is_refused_and_leaks_nothing(
    consumers, transport, kind, caplog
):
    """A producer's Admit or Offer that a session thread read just before ``close()`` and handles after it: the
    closed consumer grants it no block (no reaper is left to free them) and no error escapes into its log. The
    session thread is held between reading the message and admitting it while the consumer closes."""
    from .rawpeer import RawPeer

    spec = Spec()
    consumer = consumers(spec)
    tensors, kw, _, _ = spec.build(seed=1)
    raw = RawPeer(consumer.address)
    assert isinstance(raw.hello(spec.layout(tensors, kw), transport), wire.Welcome)
    c, read, go = consumer.c, threading.Event(), threading.Event()
    paged = c._paged

    def held(*args):
        read.set()
        go.wait(10)
        return paged(*args)

    c._paged = held
    if kind == "admit":
        raw.send(wire.Admit(req="late", num_blocks=3, deadline_ms=5000))
    else:
        raw.send(wire.Offer(req="late", gen=1, ids=wire.ids_to_bytes(np.array([1, 2, 3])), lease_ms=5000))
    assert read.wait(10)
    c.close()
    go.set()
    assert wait_for(lambda: not any(t.name.startswith("kvxfer-worker") for t in threading.enumerate()), 5)
    time.sleep(0.2)  # the session thread ends its message
    assert c.allocator.num_free == spec.num_blocks and c.grants.counts()["inflight"] == 0
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []
    raw.close()


def test_nothing_is_handed_off_after_close_returned(consumers, transport):
    """A push whose last message a session thread read just before ``close()`` completes after it: the closed
    consumer takes it back (its blocks go back, the producer is not acknowledged) instead of queueing an
    arrival nobody will take once ``close()`` returned."""
    spec = Spec()
    consumer = consumers(spec)
    producer = Producer(spec.layout(*spec.build(seed=1)[:2]), transport=transport)
    c, done, go = consumer.c, threading.Event(), threading.Event()
    ready = c.grants.done

    def held(*args):
        slot = ready(*args)
        done.set()
        go.wait(10)
        return slot

    c.grants.done = held
    try:
        t = producer.push(c.address, "late", [1, 2, 3])
        assert done.wait(10)
        c.close()
        go.set()
        with pytest.raises((PeerError, ClosedError)):
            t.wait(10)
        assert wait_for(lambda: c.allocator.num_free == spec.num_blocks, 5)
        with pytest.raises(DeadlineError):
            c.get(timeout=0.2)
        assert c.grants.counts() == {"inflight": 0, "handed": 0, "dying": 0}
    finally:
        go.set()
        producer.close()


def test_every_push_started_around_a_producer_close_ends(consumers, transport):
    """Callers keep pushing from two threads while another closes the producer: every transfer they got ends
    (done, or a typed error) within seconds. A push waiting on the worker pool for its session when the close
    cancelled the pool's queue stayed pending for good."""
    spec = Spec()
    consumer = consumers(spec)
    tensors, kw, _, _ = spec.build(seed=1)
    for rnd in range(4):
        producer = Producer(spec.layout(tensors, kw), transport=transport, deadline=3.0)
        started: list = []
        stop = threading.Event()

        def push(name: str, producer=producer, started=started, stop=stop, rnd=rnd) -> None:
            for i in itertools.count():
                if stop.is_set():
                    return
                try:
                    started.append(producer.push(consumer.address, f"{name}-{rnd}-{i}", [i % spec.num_blocks]))
                except ClosedError:
                    return

        threads = [threading.Thread(target=push, args=(f"t{k}",)) for k in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.01 * (rnd + 1))
        producer.close()
        stop.set()
        for t in threads:
            t.join(10)
        assert started and wait_for(lambda started=started: all(t.done() for t in started), 5)
        assert {type(t.error) for t in started if t.error is not None} <= {ClosedError, PeerError, BusyError}
        while True:
            try:
                consumer.release(consumer.get(timeout=0.5).req)
            except DeadlineError:
                break
        assert wait_for(lambda: _settled(consumer, spec.num_blocks), 5)
