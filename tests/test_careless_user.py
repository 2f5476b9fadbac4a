"""What a careless user meets: every mistake is a kvxfer error that says what is wrong."""

import os
import socket
import threading
import time

import numpy as np
import pytest

from conformance.peers import wait_for
from kvxfer import (
    BlockError,
    CancelledError,
    ConfigError,
    Consumer,
    DeadlineError,
    KVLayout,
    Producer,
    ProtocolError,
)


def _layout():
    return KVLayout.from_tensors([np.zeros((8, 2, 4, 8), np.float16) for _ in range(2)])


@pytest.mark.parametrize("address", ["localhost", "127.0.0.1:http", "127.0.0.1:99999", "", "127.0.0.1: 80", None])
def test_malformed_addresses_are_config_errors(address):
    with Producer(_layout(), transport="tcp") as p, pytest.raises(ConfigError):
        p.push(address, "r", [1]).wait(5)
    with pytest.raises(ConfigError):
        Consumer(_layout(), transport="tcp", listen=address)


def test_pushing_to_an_http_port_says_so():
    server = socket.create_server(("127.0.0.1", 0))

    def http_server():  # answers whatever arrives the way HTTP servers answer garbage
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        conn.close()

    threading.Thread(target=http_server, daemon=True).start()
    with Producer(_layout(), transport="tcp") as p, pytest.raises(ProtocolError, match="HTTP"):
        p.push(f"127.0.0.1:{server.getsockname()[1]}", "r", [1]).wait(5)
    server.close()


@pytest.fixture
def pair():
    with Consumer(_layout(), transport="tcp") as c, Producer(_layout(), transport="tcp", listen="127.0.0.1:0") as p:
        yield p, c


BAD_SECONDS = [0, -1, float("nan"), float("inf"), "soon", None, True]


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_deadlines_and_leases_that_are_no_number_of_seconds_are_config_errors(pair, value):
    """NaN and infinity pass or fail every comparison: a wait on them ends never or at once, and turning them
    into the wire's milliseconds raised ValueError / OverflowError out of push()."""
    p, c = pair
    calls = [
        lambda: p.push(c.address, "r", [1], deadline=value),
        lambda: p.offer(c.address, "r", [1], lease=value),
        lambda: p.hold("r", [1], lease=value),
        lambda: c.fetch(p.address, "r", [1], deadline=value),
        lambda: Producer(_layout(), transport="tcp", deadline=value),
        lambda: Consumer(_layout(), transport="tcp", deadline=value),
    ]
    for call in calls[4:] if value is None else calls:  # None: a call's "the handle's default"
        with pytest.raises(ConfigError):
            call()
    assert c.stats()["free_blocks"] == 8 and not p.leases.active


@pytest.mark.parametrize(
    "meta",
    [
        {"x": object()},
        {1: "a"},
        {"x": "a" * (2 << 20)},
        {"x": b"raw"},
        ["not", "a", "dict"],
        {"x": {"y": {"z": {"w": {"v": [1]}}}}},
    ],
)
def test_meta_the_wire_cannot_carry_is_refused_before_it_costs_the_session(pair, meta):
    """The consumer ends a whole session on a message it cannot decode: a bad meta must fail its own call, and
    the session's other transfers go on."""
    p, c = pair
    for call in (lambda: p.push(c.address, "r", [1], meta=meta), lambda: p.offer(c.address, "r", [1], meta=meta)):
        with pytest.raises(ConfigError, match="meta"):
            call()
    p.push(c.address, "fine", [2], meta={"first_token": 7}).wait(5)
    a = c.get(5)
    assert (a.req, a.meta) == ("fine", {"first_token": 7}) and c.release("fine")


@pytest.mark.parametrize("req", ["", "r" * 5000, None, 1.5, b"bytes", True])
def test_request_ids_that_are_empty_huge_or_not_text_are_config_errors(pair, req):
    p, c = pair
    for call in (lambda: p.push(c.address, req, [1]), lambda: c.fetch(p.address, req, [1])):
        with pytest.raises(ConfigError, match="request id"):
            call()


def test_waits_take_a_negative_timeout_as_a_look_and_nan_as_a_mistake(pair):
    p, c = pair
    t = p.push(c.address, "r", [1])
    assert t.wait(5) is t and t.wait(-1) is t and t.wait_ended(-3)
    assert c.get(timeout=5).req == "r" and c.release("r")
    with pytest.raises(DeadlineError):
        c.get(timeout=-1)
    for wait in (lambda: c.get(timeout=float("nan")), lambda: t.wait(float("nan")), lambda: c.get(timeout="1")):
        with pytest.raises(ConfigError):
            wait()


def test_a_part_outside_its_senders_is_refused_at_the_source(pair):
    p, c = pair
    for senders, part in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(BlockError, match="senders"):
            p.push(c.address, "r", [1], senders=senders, part=part, layers=[0])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _back_to(before: int, wait: float = 3.0) -> bool:
    """Whether this process's open fds fall back to ``before`` within ``wait`` seconds. A leak stays; an fd that a
    thread of an earlier test still holds for a moment (in CI, beside the end-to-end run, one was counted once)
    goes."""
    end = time.monotonic() + wait
    while _open_fds() > before:
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize(
    "options",
    [
        {"workers": 0},
        {"max_inflight": 0},
        {"quarantine": -1},
        {"quarantine": float("nan")},
        {"tombstone_ttl": float("inf")},
        {"retry_after": "soon"},
        {"handshake_timeout": 0},
        {"spin": -1},
        {"spin": 1.0},
    ],
)
def test_consumer_options_out_of_range_are_config_errors_and_open_nothing(options):
    """A NaN quarantine kept failed blocks for good; workers=0 raised ValueError; nothing may stay open."""
    before = _open_fds()
    with pytest.raises(ConfigError):
        Consumer(_layout(), transport="tcp", **options)
    assert _back_to(before), (_open_fds(), before)


def test_listening_where_this_host_cannot_is_a_config_error_and_opens_nothing():
    """A taken port or a foreign address raised OSError, after the transports (a NIXL agent) were opened."""
    with Consumer(_layout(), transport="tcp") as c:
        before = _open_fds()
        for make in (
            lambda: Consumer(_layout(), transport="tcp", listen=c.address),
            lambda: Producer(_layout(), transport="tcp", listen=c.address),
            lambda: Consumer(_layout(), transport="tcp", listen="192.0.2.1:0"),  # TEST-NET-1: never this host's
        ):
            with pytest.raises(ConfigError, match="cannot listen"):
                make()
        assert _back_to(before), (_open_fds(), before)


def test_close_wakes_a_blocked_get_and_later_gets_say_closed():
    from kvxfer import ClosedError

    consumer = Consumer(_layout(), transport="tcp")
    ended = []

    def runtime():
        try:
            consumer.get()  # a decode loop's `while True: get()`
        except ClosedError:
            ended.append(time.monotonic())

    t = threading.Thread(target=runtime)
    t.start()
    time.sleep(0.1)
    closed = time.monotonic()
    consumer.close()
    t.join(5)
    assert ended and ended[0] - closed < 1
    start = time.monotonic()
    with pytest.raises(ClosedError):
        consumer.get(timeout=5)
    assert time.monotonic() - start < 1


def test_the_service_queue_ends_at_close_and_takes_an_infinite_timeout():
    from kvxfer import ClosedError
    from kvxfer.runtime.service import ReceiveService

    service = ReceiveService(_layout(), transport="tcp", metrics=False)
    threading.Timer(0.2, service.close).start()
    with pytest.raises(ClosedError):
        service.next(timeout=float("inf"))
    with pytest.raises(ConfigError):
        service.next(timeout=float("nan"))


@pytest.mark.parametrize("timeout", [float("inf"), 1e10, 1e300])
def test_a_huge_timeout_waits_until_the_thing_happens(timeout):
    from kvxfer import ClosedError

    consumer = Consumer(_layout(), transport="tcp")
    threading.Timer(0.2, consumer.close).start()
    with pytest.raises(ClosedError):
        consumer.get(timeout=timeout)


@pytest.mark.parametrize("seconds", [1e10, 1e18])
def test_a_huge_deadline_or_lease_is_taken_as_the_longest_one(seconds):
    with Consumer(_layout(), transport="tcp") as c, Producer(_layout(), transport="tcp") as p:
        for i in range(2):  # the first dials the session, the second finds it up
            p.push(c.address, f"push-{i}", [1], deadline=seconds).wait(10)
            c.release(c.get(5).req)
            p.offer(c.address, f"pull-{i}", [2], lease=seconds).wait(10)
            c.release(c.get(5).req)


def test_closing_a_producer_ends_pushes_queued_behind_a_silent_handshake_at_once():
    from kvxfer import ClosedError

    server = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(100)], daemon=True).start()
    address = f"127.0.0.1:{server.getsockname()[1]}"
    p = Producer(_layout(), transport="tcp")
    transfers = [p.push(address, f"q{i}", [1], deadline=30) for i in range(12)]
    time.sleep(0.3)
    p.close()
    for t in transfers:
        with pytest.raises(ClosedError):
            t.wait(2)
    time.sleep(0.3)
    assert len(held) == 1  # no handshake began after the close
    server.close()


def test_auth_and_transport_of_the_wrong_type_are_config_errors():
    with pytest.raises(ConfigError, match="auth"):
        Producer(_layout(), transport="tcp", auth=123)
    with pytest.raises(ConfigError, match="transport"):
        Consumer(_layout(), transport=["tcp"])


def test_ids_meta_and_tokens_the_wire_cannot_carry_are_refused_at_the_call():
    with Producer(_layout(), transport="tcp") as p:
        with pytest.raises(ConfigError, match="Unicode"):
            p.push("127.0.0.1:1", "req-\udcff", [1])  # what os.fsdecode makes of undecodable bytes
        with pytest.raises(ConfigError, match="meta"):
            p.push("127.0.0.1:1", "r", [1], meta={"h": 2**64})
        for tokens in (float("nan"), 2.5, True, "4"):
            with pytest.raises(BlockError, match="tokens"):
                p.push("127.0.0.1:1", "r", [1], tokens=tokens)
        p.push("127.0.0.1:1", "r", [1, 2], tokens=6.0).cancel()  # a whole number, whatever its type
    with Consumer(_layout(), transport="tcp") as c, pytest.raises(BlockError, match="tokens"):
        c.fetch("127.0.0.1:1", "r", [1], tokens=float("nan"))


def test_a_cache_of_python_objects_is_a_layout_error():
    from kvxfer import LayoutError

    with pytest.raises(LayoutError, match="Python objects"):
        KVLayout.from_tensors([np.zeros((8, 2, 4, 8), object)])


def test_a_runtime_allocator_that_answers_wrongly_refuses_that_request_and_keeps_the_session():
    class Flaky:  # the decode runtime's allocator, with bugs: wrong answers first, then right ones
        def __init__(self):
            self.free_list = FreeList(8)
            self.answers = iter([lambda n: [5] * n, lambda n: [99] * n, lambda n: [1], "raise"])

        def allocate(self, n):
            wrong = next(self.answers, None)
            if wrong == "raise":
                raise RuntimeError("out of sync")
            return self.free_list.allocate(n) if wrong is None else np.array(wrong(n))

        def free(self, ids):
            self.free_list.free(ids)

    from kvxfer import FreeList

    with Consumer(_layout(), transport="tcp", allocator=Flaky()) as c, Producer(_layout(), transport="tcp") as p:
        for why in ("duplicates", "out of range", "1 blocks allocated for 2", "failed"):
            with pytest.raises(BlockError, match="allocator") as e:
                p.push(c.address, "r", [1, 2], deadline=5).wait(10)
            assert why in str(e.value)
        p.push(c.address, "r", [1, 2], deadline=5).wait(10)  # the same session, the allocator mended
        assert c.get(5).req == "r"
        assert c.stats()["sessions"] == 1


def test_a_fetch_carries_the_meta_of_the_hold():
    layout = _layout()
    with (
        Producer(layout, transport="tcp", listen="127.0.0.1:0") as p,
        Consumer(layout, transport="tcp") as c,
    ):
        held = p.hold("h", [1, 2], lease=10, meta={"first_token": 42})
        f = c.fetch(held.ticket["address"], "h", [3, 4], deadline=10)
        f.wait(10)
        assert f.meta == {"first_token": 42}
        held.wait(10)


def test_counts_and_callbacks_of_the_wrong_type_are_refused_at_the_call():
    with Producer(_layout(), transport="tcp") as p, Consumer(_layout(), transport="tcp") as c:
        for kwargs in ({"senders": "2"}, {"part": -1}, {"heads": 5}, {"heads": ["a", "b"]}, {"senders": True}):
            with pytest.raises(BlockError):
                p.push(c.address, "r", [1], **kwargs)
        for kwargs in ({"skip": "1"}, {"from_token": 1.5}, {"readers": "x"}, {"readers": 0}):
            with pytest.raises(BlockError):
                c.fetch("127.0.0.1:1", "r", [1], **kwargs)
        t = p.push(c.address, "ok", [1])
        with pytest.raises(TypeError):
            t.add_done_callback(None)
        t.wait(5)
    with pytest.raises(ConfigError):
        Producer(_layout(), transport="tcp", inline_max="1")


def test_cancel_and_wait_answer_alike_on_a_push_and_a_fetch_whatever_the_order():
    """A transfer nobody waited on yet, one cancelled before any wait, one waited on after it ended: ``cancel``
    says True once and False after, ``wait`` and ``done`` agree. The producer here never answers (a listening
    socket nobody accepts on), so only the cancel ends these."""
    silent = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    with Producer(_layout(), transport="tcp") as p, Consumer(_layout(), transport="tcp") as c:
        for t in (p.push(address, "r", [1], deadline=30), c.fetch(address, "r", [1, 2], deadline=30)):
            assert not t.done()
            assert t.cancel("changed my mind") is True
            assert t.cancel("again") is False
            assert t.done()
            with pytest.raises(CancelledError):
                t.wait(5)
            assert isinstance(t.exception(0), CancelledError)
        done_before_wait = p.push(c.address, "ok", [1, 2])
        assert c.get(timeout=10).req == "ok"
        assert wait_for(done_before_wait.done, 5)
        assert done_before_wait.wait(0) is done_before_wait
        assert done_before_wait.cancel() is False
    silent.close()
