"""A TCP link's data connections when the link closes while bytes move: the native movers work on the raw
descriptor number for a whole window, so a closing link must stop them without closing that number under them
(closed, it is reused at once by the next socket, pipe or file the process opens, and the mover's next call
would write KV bytes into it). Real sockets and the real native mover."""

import socket
import threading

import numpy as np
import pytest

from kvxfer import KVXferError
from kvxfer.channel import Channel
from kvxfer.sockets import send_extents
from kvxfer.transports.tcp.pool import Connections


def _conns() -> Connections:
    def dial(purpose: str) -> Channel:
        raise AssertionError("not dialled here")

    return Connections(dial, streams=2)


def test_closing_a_link_stops_a_native_send_in_flight_and_leaves_the_descriptor_to_its_mover():
    conns = _conns()
    ours, peer = socket.socketpair()
    ch = conns.track(Channel(ours))
    fd = ours.fileno()
    region = np.arange(64 << 20, dtype=np.uint8)  # far more than the socket buffers hold: the send blocks
    bases = np.array([region.ctypes.data], dtype=np.uint64)
    sizes = np.array([region.nbytes], dtype=np.int64)
    outcome: list = []

    def mover() -> None:
        try:
            send_extents(ours, bases, sizes, np.zeros(1, np.int64), np.zeros(1, np.int64), sizes.copy())
            outcome.append(None)
        except KVXferError as e:
            outcome.append(e)

    t = threading.Thread(target=mover, daemon=True)
    t.start()
    peer.recv(1 << 16)  # the send is under way
    conns.close()
    t.join(10)
    assert not t.is_alive(), "a closing link must stop a blocked native send"
    assert isinstance(outcome[0], KVXferError)
    assert ours.fileno() == fd, "the descriptor was closed under its mover"
    conns.drop(ch)  # the mover lets go: now it closes
    assert ours.fileno() == -1
    peer.close()


def test_a_connection_given_back_to_a_closed_link_is_closed_and_idle_ones_close_with_the_link():
    conns = _conns()
    pairs = [socket.socketpair() for _ in range(3)]
    idle, held_push, held_pull = (conns.track(Channel(a)) for a, _ in pairs)
    conns.pulls.put(idle)
    conns.close()
    assert idle.closed, "an idle connection closes with the link"
    assert not held_push.closed and not held_pull.closed
    for _, peer in pairs[1:]:
        assert peer.recv(1) == b"", "a held connection is shut down: its peer sees the end at once"
    conns.give_back(conns.pushes, held_push)
    conns.give_back(conns.pulls, held_pull)
    assert held_push.closed and held_pull.closed
    assert conns.pushes.empty() and conns.pulls.empty()
    with pytest.raises(KVXferError):
        conns.track(Channel(socket.socketpair()[0]))
    for a, b in pairs:
        a.close()
        b.close()
