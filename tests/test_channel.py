"""The framed channel against slow and greedy peers, over real socket pairs: a deadline bounds a whole message,
memory follows the bytes that arrived (not the size a peer announces), and a per-message frame limit holds."""

import socket
import struct
import threading
import time
import tracemalloc

import pytest

from kvxfer import ConfigError, DeadlineError, PeerError, ProtocolError, wire
from kvxfer.channel import Channel, Spin


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield Channel(a), b
    a.close()
    b.close()


def _dribble(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> threading.Thread:
    """Send ``data`` one byte per ``every`` seconds until done or ``stop``; then close the socket."""

    def run():
        try:
            for i in range(len(data)):
                if stop.wait(every):
                    break
                sock.sendall(data[i : i + 1])
        except OSError:
            pass
        finally:
            sock.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_dribbling_peer_times_out_within_the_whole_message_deadline(pair):
    ch, peer = pair
    stop = threading.Event()
    # announces 64 MiB, then a byte every 0.1 s: each read succeeds, only a whole-message deadline ends it
    t = _dribble(peer, struct.pack(">I", 64 << 20) + b"\x00" * 100, 0.1, stop)
    t0 = time.monotonic()
    with pytest.raises(DeadlineError):
        ch.recv(1.0)
    elapsed = time.monotonic() - t0
    stop.set()
    t.join(5)
    assert 0.9 <= elapsed < 2.0, elapsed


def test_a_dribbled_header_times_out(pair):
    ch, peer = pair
    stop = threading.Event()
    t = _dribble(peer, b"\x00\x00\x00\x10" + b"\x00" * 16, 0.4, stop)
    with pytest.raises(DeadlineError):
        ch.recv(1.0)
    stop.set()
    t.join(5)


def test_the_announced_size_is_not_allocated_up_front(pair):
    ch, peer = pair
    peer.sendall(struct.pack(">I", 64 << 20) + b"\x00" * 4096)
    tracemalloc.start()
    try:
        with pytest.raises(DeadlineError):
            ch.recv(0.3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * Channel.CHUNK, peak  # not 64 MiB


def test_a_smaller_frame_limit_per_message(pair):
    ch, peer = pair
    msg = wire.Grant(req="r", gen=1, ids=wire.ids_to_bytes(range(40000)))  # a 160 KB frame
    peer.sendall(wire.encode(msg))
    with pytest.raises(ProtocolError, match="refused"):
        ch.recv(1.0, max_frame=64 << 10)


def test_a_slow_but_timely_message_arrives_whole(pair):
    ch, peer = pair
    frame = wire.encode(wire.Ack(req="slow", gen=7))
    stop = threading.Event()
    t = _dribble(peer, frame, 0.01, stop)
    assert ch.recv(5.0) == wire.Ack(req="slow", gen=7)
    t.join(5)


def test_a_large_message_arrives_intact_across_chunks(pair):
    ch, peer = pair
    ids = list(range(1_000_000))  # 4 MB of ids: many chunks
    msg = wire.Grant(req="big", gen=2, ids=wire.ids_to_bytes(ids))
    sender = threading.Thread(target=peer.sendall, args=(wire.encode(msg),), daemon=True)
    sender.start()
    got = ch.recv(10.0)
    sender.join(5)
    assert got == msg


def test_eof_mid_body_is_a_peer_error(pair):
    ch, peer = pair
    peer.sendall(struct.pack(">I", 100) + b"\x00" * 10)
    peer.close()
    with pytest.raises(PeerError):
        ch.recv(1.0)


# ---- the reader's spin ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", [-1e-6, 0.5, True, "1e-4", float("nan")])
def test_a_spin_outside_0_to_10ms_is_refused(limit):
    with pytest.raises(ConfigError, match="spin"):
        Spin(limit)


def test_spin_zero_never_spins_even_after_a_send():
    s = Spin(0)
    now = time.monotonic_ns()
    s.sent(now)
    assert not s.start(now)


def test_an_idle_reader_stops_spinning_and_a_quick_message_or_a_send_restarts_it():
    s, now = Spin(1e-4), time.monotonic_ns()
    assert s.start(now) and s.until[0] == now + 100_000
    for k in range(Spin.IDLE_AFTER):  # every message came long after the spin gave up
        now += 10_000_000
        assert s.start(now), k
        s.took(0.01)
    now += 10_000_000
    assert not s.start(now)  # idle: block at once
    s.took(50e-6)  # one came soon after the reader blocked: spin again
    assert s.start(now)
    for _ in range(Spin.IDLE_AFTER):
        s.took(0.01)
    now += 10_000_000
    assert not s.start(now)
    s.sent(now)  # a send of ours: its answer is due
    assert s.start(now + 50_000) and not s.start(now + 100_001)
    s.took(None)  # it came during the spin
    assert s.start(now + 200_000)


def test_messages_arrive_whole_while_the_reader_spins_for_them(pair):
    ch, peer = pair
    msgs = [wire.Ack(req=f"r{i}", gen=i) for i in range(300)]

    def send():
        for i, m in enumerate(msgs):
            if i % 3 == 0:
                time.sleep(0.0002 * (i % 7))  # some inside the spin, some after it
            peer.sendall(wire.encode(m))

    th = threading.Thread(target=send, daemon=True)
    th.start()
    assert [ch.recv(5.0) for _ in msgs] == msgs
    th.join(5)
