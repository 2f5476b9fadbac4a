"""``Transfer`` as a future: callbacks, Busy retried inside ``push``, and ``push`` never waiting on a connection."""

import socket
import time

import numpy as np
import pytest

from kvxfer import BusyError, Consumer, DeadlineError, KVLayout, Producer, Status


def _caches(fill: int):
    caches = [np.full((16, 2, 4, 8), fill, np.float16) for _ in range(2)]
    return caches, KVLayout.from_tensors(caches)


@pytest.fixture
def pair(transport):
    _, src = _caches(3)
    _, dst = _caches(0)
    with Consumer(dst, transport=transport, retry_after=0.05) as c, Producer(src, transport=transport) as p:
        yield p, c


def test_done_callbacks_run_once_and_late_ones_at_once(pair):
    p, c = pair
    seen = []
    t = p.push(c.address, "r", [1, 2])
    t.add_done_callback(lambda x: seen.append(("early", x.status)))
    t.add_done_callback(lambda x: 1 / 0)  # a broken callback is logged, never raised into the transport
    t.wait(10)
    t.add_done_callback(lambda x: seen.append(("late", x.status)))
    assert seen == [("early", Status.DONE), ("late", Status.DONE)]
    assert t.result(1) is t and t.exception(1) is None
    c.release(c.get(5).req)


def test_busy_is_retried_inside_push_until_admitted(pair):
    p, c = pair
    p.push(c.address, "first", np.arange(15)).wait(10)
    held = c.get(5)  # 1 of 16 blocks left: the next two-block request is Busy while this one is held
    with pytest.raises(BusyError):
        p.push(c.address, "no-retry", [2, 3]).wait(10)
    t = p.push(c.address, "retried", [2, 3], retry_busy=True)
    until = time.monotonic() + 5  # a loaded CI machine (e2e servers beside) can take longer than a few retry periods
    while t.busy_retries < 2 and time.monotonic() < until:
        time.sleep(0.01)
    assert not t.done() and t.busy_retries >= 2
    c.release(held.req)
    assert t.wait(10).status is Status.DONE
    c.release(c.get(5).req)


def test_busy_retries_end_at_the_deadline(pair):
    p, c = pair
    p.push(c.address, "first", np.arange(15)).wait(10)
    start = time.monotonic()
    t = p.push(c.address, "late", [2, 3], retry_busy=True, deadline=0.5)
    with pytest.raises(DeadlineError, match="stayed busy"):
        t.wait(5)
    # ends at its deadline, not at the 5 s wait (CI beside the e2e servers once took 1.77 s)
    assert 0.45 < time.monotonic() - start < 2.5
    c.release(c.get(5).req)


def test_push_returns_at_once_while_the_consumer_never_answers(transport):
    _, src = _caches(3)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks: a hung handshake
    with Producer(src, transport=transport, connect_timeout=0.5) as p:
        start = time.monotonic()
        t = p.push(f"127.0.0.1:{silent.getsockname()[1]}", "r", [1])
        # returns before the 0.5 s handshake could end (CI beside the e2e servers once took 0.15 s)
        assert time.monotonic() - start < 0.3
        with pytest.raises(DeadlineError):
            t.wait(5)
    silent.close()
