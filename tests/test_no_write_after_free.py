"""No byte lands in a consumer block after the block went back to the allocator (issue 11, defect 1).

A real Producer in one child process moves a 64 MiB request to a real Consumer in another, whose allocator
(``GuardedAllocator``) poisons every freed block. The transfer is ended early, in every way one can end early,
while bytes are still arriving: the consumer is slowed down (SIGSTOP/SIGCONT, 1 ms running in every 50) so
its socket buffers stay full and "midway" lasts long enough to hit. After each ending every freed block must
still hold its poison, the allocator must be full again, and no block may have been freed twice.
"""

from __future__ import annotations

import time

import pytest

from conformance.kvspec import Spec
from support import ConsumerChild, GuardedAllocator, ProducerChild, Throttle

# each test slows a peer with SIGSTOP / SIGCONT from a thread so as to end its transfer midway: on a machine busy
# with other work the transfer can finish first, or a stop outlast the quarantine (make test runs these alone)
pytestmark = pytest.mark.quiet

SPEC = Spec(kind="nhd", num_blocks=160, layers=8, heads=8, block_size=32, head_dim=64)  # 512 KiB blocks
N = 128  # 64 MiB
LINGER = 0.2  # after every block is back: longer than any late writer (the TCP watchdog looks every 50 ms)


def one_piece(transport: str) -> dict:
    """TCP with one data connection, NIXL with one lane, as these tests are paced: a second one doubles what
    lands in each running slice of a slowed process. A lease-ended pull once had 93% of its bytes when it ended,
    and a NIXL push over two lanes was whole when its cancel came (each lane's copy is one system call)."""
    options = {"tcp": {"streams": 1}, "nixl": {"lanes": 1}}.get(transport)
    return {"transport_options": options} if options else {}


# the consumer's kernel buffer for a pull's bytes: this machine's tcp_rmem lets one grow to 32 MiB, which a stopped
# consumer's producer fills in one stop, so that a 64 MiB pull was whole in a few running slices (CI saw a
# lease-ended pull with 100% of its bytes); 256 KiB makes each slice land about 512 KiB (the kernel doubles it)
RCVBUF = 256 << 10


@pytest.fixture
def consumer(transport):
    paced = {**one_piece(transport), "rcvbuf": RCVBUF} if transport == "tcp" else one_piece(transport)
    c = ConsumerChild(SPEC, transport, quarantine=0.2, deadline=20.0, **paced)
    yield c
    c.close()


@pytest.fixture
def producer(transport, consumer):
    """A producer already in session with the consumer (a slowed handshake would eat the lease)."""
    p = ProducerChild(SPEC, transport, seed=3, **one_piece(transport))
    p.start("offer", consumer.address, "warm-up", 1, fill=False, lease=20.0)
    assert consumer.release(consumer.get(20)["req"])
    assert p.wait_ended("warm-up", 10)["error"] is None
    yield p
    p.close()


def _assert_clean(consumer: ConsumerChild) -> None:
    r = consumer.settle(LINGER)
    assert r["after_free"] == [], "bytes landed in blocks after they were freed"
    assert r["bad_frees"] == []
    assert r["full"], f"blocks still held: {r['stats']}"
    s = r["stats"]
    assert s["inflight"] == s["handed"] == s["dying"] == 0, s
    assert r["untyped"] == []


PULL_ENDINGS = ["producer_cancel", "deadline", "producer_close", "producer_killed"]
EXPIRED = ("DeadlineError", "LeaseExpiredError", "TimeoutError")


@pytest.mark.parametrize("ending", PULL_ENDINGS)
def test_pull_ended_early_writes_nothing_after_free(consumer, producer, transport, ending):
    c, p = consumer, producer
    with Throttle(c) as slow:
        # the slowed consumer may need seconds to start the pull, and a read stops at its lease's end: the lease
        # leaves room (over ucx the first block is touched only once a whole 8 MiB window arrived; CI once saw a
        # 4 s lease end before that, and the test found no bytes at all)
        lease = 8.0 if ending == "deadline" else 20.0
        lease_end = time.monotonic() + lease
        p.start("offer", c.address, "big", N, fill=False, lease=lease)
        ids = c.wait_bytes(N)
        if ending == "deadline":
            # from its first bytes the consumer stays stopped until the lease ran out midway; slowing it further
            # was not enough: on a loaded machine the throttle's 1 ms running slices overshoot, and CI saw the pull
            # whole before the lease's end. What lands after the stop is bounded by the socket buffers (a few MiB)
            slow.freeze()
            time.sleep(max(0.0, lease_end + 0.5 - time.monotonic()))
            c.cont()
        elif ending == "producer_cancel":
            cancelled = p.cancel("big")
        elif ending == "producer_close":
            p.close_producer()
        elif ending == "producer_killed":
            p.kill()
        landed = c.wait_failed(ids)
    # a one-sided READ may copy the rest in one system call once the stopped consumer runs: over nixl the pull
    # can finish before it is ended, and then only the allocator checks apply
    midway = transport == "tcp" or landed < 1.0
    if transport == "tcp":
        assert landed < 0.9, f"the pull had {landed:.0%} of its bytes when it ended: this run proves little"
    if ending == "producer_cancel":
        assert cancelled or not midway
    if ending in ("producer_cancel", "deadline"):
        r = p.wait_ended("big", 10)
        expected = ("CancelledError",) if ending == "producer_cancel" else EXPIRED
        assert r["error"] in (expected if midway else (*expected, None)), r
    _assert_clean(c)


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_push_cancelled_midway_writes_nothing_after_free(consumer, producer, transport, side):
    c, p = consumer, producer
    # a one-sided WRITE is the producer's doing: stopping the consumer would not slow it
    with Throttle(p if transport == "nixl" else c):
        p.start("push", c.address, "big", N, fill=False, deadline=20.0)
        ids = c.wait_bytes(N)
        cancelled = p.cancel("big") if side == "producer" else c.cancel("big")
        landed = c.wait_failed(ids)
    if not cancelled and transport == "nixl":
        # one process_vm_writev can land the whole WRITE inside one of the producer's 1 ms running slices: the
        # push was complete before the cancel, and only the allocator checks apply
        assert p.wait_ended("big", 10)["error"] is None
        _assert_clean(c)
        return
    assert cancelled
    assert landed < 0.9, f"the push had {landed:.0%} of its bytes when it ended: this run proves little"
    r = p.wait_ended("big", 10)
    # a consumer's cancel may also surface as PeerError: test_consumer_cancel_of_a_push_reaches_the_producer_as_cancel
    assert r["error"] in (("CancelledError",) if side == "producer" else ("CancelledError", "PeerError")), r
    _assert_clean(c)


def test_a_complete_pull_lands_every_byte(consumer, producer):
    """The control: the same 64 MiB pull, slowed but not ended early, arrives whole and leaves nothing held."""
    c, p = consumer, producer
    with Throttle(c):
        p.start("offer", c.address, "whole", N, lease=20.0)
        a = c.get(20)
    assert a is not None and a["intact"], a
    assert p.wait_ended("whole", 10)["error"] is None
    assert c.release("whole")
    _assert_clean(c)


TRIALS = 8


@pytest.mark.parametrize("transport", ["tcp"])
def test_consumer_cancel_of_a_push_reaches_the_producer_as_cancel(consumer, producer):
    """The producer is told *why*: every push the consumer cancelled ends with CancelledError, never with a
    lost peer (which a connector would take as a reason to give up on the consumer)."""
    c, p, errors = consumer, producer, []
    for i in range(TRIALS):
        with Throttle(p):  # the producer slowed: the broken socket and the Cancel frame reach it together
            p.start("push", c.address, f"big-{i}", N, fill=False, deadline=20.0)
            c.wait_bytes(N)
            assert c.cancel(f"big-{i}")
        errors.append(p.wait_ended(f"big-{i}", 10)["error"])
        _assert_clean(c)
    assert errors == ["CancelledError"] * TRIALS


def test_consumer_close_stops_a_pull_from_a_stopped_producer():
    """Closing the consumer ends every receive at once: no block stays held, waiting on a peer that may never
    send again."""
    from kvxfer import Consumer

    tensors, kw, _, _ = SPEC.build(fill=0)
    layout = SPEC.layout(tensors, kw)
    p = ProducerChild(SPEC, "tcp", seed=3, **one_piece("tcp"))
    midway = 0  # rounds that froze the producer with the pull under 90% done
    try:
        # the reader may be between two waits that do look at the close: three rounds. On a loaded machine this
        # process can be kept off the CPU until the throttled pull is all but done: such a round does not count.
        for r in range(8):
            if midway == 3:
                break
            guard = GuardedAllocator(layout)
            c = Consumer(layout, transport="tcp", allocator=guard, deadline=20.0, **one_piece("tcp"))
            try:
                slow = Throttle(p).__enter__()
                p.start("offer", c.address, f"big-{r}", N, fill=False, lease=20.0)
                end = time.monotonic() + 20
                while not (len(guard.allocated()) == N and guard.touched(guard.allocated())):
                    assert time.monotonic() < end, "no bytes arrived"
                    time.sleep(0.0005)
                slow.freeze()
                midway += guard.progress(guard.allocated()) < 0.9
                c.close()
                end = time.monotonic() + 1.0
                while (c.stats()["dying"] or not guard.full) and time.monotonic() < end:
                    time.sleep(0.01)
                assert c.stats()["dying"] == 0 and guard.full, c.stats()
            finally:
                p.cont()
                c.close()
            assert guard.check() == [] and guard.bad_frees() == []
    finally:
        p.close()
    assert midway == 3, f"only {midway} of the rounds caught the pull midway"


SMALL = Spec(kind="nhd", num_blocks=64, layers=4, heads=4, block_size=16, head_dim=64)  # 64 KiB blocks
BATCH, ROUNDS = 32, 4


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_a_stopped_producer_never_writes_a_freed_grant(transport):
    """A producer that stops (a GC pause, a starved CPU, SIGSTOP) holding grants it has not used yet: the
    consumer times them out and may reuse the blocks only once nothing can write them any more.

    The producer is stopped before its grants arrive (``stop`` waits until every thread is stopped: a SIGSTOP
    that took effect a few milliseconds late let a grant be used in time, then froze the WRITE between its
    last deadline check and its post). A pause inside that window is the known limit of one-sided pushes
    (docs/transports.md); a fetch or pull has no such window."""
    c = ConsumerChild(SMALL, transport, quarantine=0.2, deadline=20.0)
    p = ProducerChild(SMALL, transport, seed=3)
    try:
        p.start("push", c.address, "warm-up", 1, fill=False, deadline=20.0)
        assert c.release(c.get(20)["req"])
        for r in range(ROUNDS):
            c.stop()  # the admissions queue up; they are granted while the producer is stopped
            for k in range(BATCH):
                p.start("push", c.address, f"r{r}-{k}", 1, fill=False, deadline=1.5)
            p.stop()
            c.cont()
            time.sleep(4.0)  # well past the deadline and the 0.2 s quarantine: the blocks are back in the allocator
            p.cont()
            assert {p.wait_ended(f"r{r}-{k}", 10)["error"] for k in range(BATCH)} <= {"DeadlineError", None}
            _assert_clean(c)
    finally:
        p.close()
        c.close()


ONE_SIDED_LIMIT = pytest.mark.xfail(
    strict=False,
    reason="known limit of one-sided writes: Consumer.close() tells every writer (Cancel), closes, and holds the "
    "grants for the quarantine, but a producer stopped longer than that can still post a WRITE it was granted "
    "before the close (over cma nothing on the receiving side can refuse it)",
)


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=ONE_SIDED_LIMIT)])
def test_consumer_close_never_lets_a_granted_push_land_after_free(transport):
    """The consumer closes while a producer holds grants it has not used: once close() returned, nothing may
    land in the blocks it gave back."""
    p = ProducerChild(SMALL, transport, seed=3)
    try:
        for r in range(2 * ROUNDS):  # a fresh consumer each round; the race is lost less often under load
            c = ConsumerChild(SMALL, transport, quarantine=2.0, deadline=20.0)
            try:
                p.start("push", c.address, f"warm-up-{r}", 1, fill=False, deadline=20.0)  # the session first
                assert c.release(c.get(20)["req"])
                c.stop()  # the admissions queue up; they are granted while the producer is stopped
                for k in range(BATCH):
                    p.start("push", c.address, f"r{r}-{k}", 1, fill=False, deadline=10.0)
                p.stop()
                c.cont()
                time.sleep(0.3)
                c.close_consumer()
                p.cont()
                for k in range(BATCH):
                    p.wait_ended(f"r{r}-{k}", 15)
                time.sleep(0.3)
                _assert_clean(c)
            finally:
                c.close()
    finally:
        p.close()
