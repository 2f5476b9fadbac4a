"""A hostile fetching consumer against a listening TCP producer, spoken by hand: it asks for a whole hold with
one ``ReadData`` and then reads slowly, past the lease. Once the hold ended for its owner (who reuses the
blocks at once), not one byte of the blocks' new contents may reach it."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from conformance.rawpeer import RawPeer
from kvxfer import KVLayout, LeaseExpiredError, Producer, wire
from kvxfer.channel import Channel

OLD, NEW = 0x11, 0x77


def _fetching_reader(producer: Producer, layout: KVLayout, n: int, req: str = "A", session: int = 7) -> tuple:
    """The consumer's side of a fetch, by hand, with a data listener whose connection reads slowly."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    peer = RawPeer(producer.address, timeout=10)
    peer.welcome(layout, f"127.0.0.1:{listener.getsockname()[1]}", session=session)
    data, _ = listener.accept()
    listener.close()
    ch = Channel(data)
    assert ch.recv(5).purpose == "pull"
    peer.send(wire.Fetch(req=req, num_blocks=n))
    offer = peer.recv()
    assert isinstance(offer, wire.Offer)
    return peer, data, offer, ch


@pytest.mark.timeout(60)
def test_a_read_past_the_lease_never_sends_the_blocks_new_contents():
    blocks = 64
    caches = [np.zeros((blocks, 2, 128, 2, 64), np.float16) for _ in range(2)]
    for c in caches:
        c.view(np.uint8)[:] = OLD
    layout = KVLayout.from_tensors(caches, dims="BKNHD")
    producer = Producer(layout, transport="tcp", listen="127.0.0.1:0", transport_options={"streams": 1})
    try:
        # the lease leaves a loaded machine room to set up the read before it ends (CI once took longer than 1 s)
        held = producer.hold("A", list(range(blocks)), lease=3.0)
        peer, data, offer, ch = _fetching_reader(producer, layout, blocks)
        total = blocks * layout.block_bytes
        ch.send(wire.ReadData(req="A", gen=offer.gen, ids=offer.ids, offset=0, length=total))
        reply = ch.recv(5)
        assert reply.ok, reply.message
        got = bytearray(data.recv(1 << 20))
        with pytest.raises(LeaseExpiredError):
            held.wait(10)
        for c in caches:  # the owner reuses the blocks the moment the hold ended
            c.view(np.uint8)[:] = NEW
        data.settimeout(5)
        end = time.monotonic() + 10
        while len(got) < total and time.monotonic() < end:
            piece = data.recv(1 << 20)
            if not piece:
                break
            got += piece
        seen = np.frombuffer(bytes(got), np.uint8)
        assert len(got) < total  # the read was cut off at the lease's end
        assert not (seen == NEW).any()
        assert (seen == OLD).all()
        peer.close()
    finally:
        producer.close()


@pytest.mark.timeout(60)
def test_a_fetcher_naming_another_fetchers_session_cannot_read_its_lease():
    """Consumers number their sessions themselves, so a second fetcher can give its session the number of the
    first one's and ask, on its own data connection, for the offer the first was made. The producer keeps its
    sessions apart by numbers of its own: the read is refused, not one byte of the other's blocks comes, and the
    offer's owner still reads it whole."""
    blocks = 16
    caches = [np.zeros((2 * blocks, 2, 8, 2, 16), np.float16) for _ in range(2)]
    for c in caches:
        c.view(np.uint8)[:] = OLD
        c[blocks:].view(np.uint8)[:] = NEW
    layout = KVLayout.from_tensors(caches, dims="BKNHD")
    producer = Producer(layout, transport="tcp", listen="127.0.0.1:0", transport_options={"streams": 1})
    try:
        producer.hold("A", list(range(blocks)), lease=20)
        producer.hold("B", list(range(blocks, 2 * blocks)), lease=20)
        owner, owner_data, offer, owner_ch = _fetching_reader(producer, layout, blocks, "A", session=1)
        thief, thief_data, _, thief_ch = _fetching_reader(producer, layout, blocks, "B", session=1)
        total = blocks * layout.block_bytes
        thief_ch.send(wire.ReadData(req="A", gen=offer.gen, ids=offer.ids, offset=0, length=total))
        reply = thief_ch.recv(5)
        assert not reply.ok and "no live offer" in reply.message, reply
        thief_data.settimeout(0.5)
        with pytest.raises(TimeoutError):
            thief_data.recv(1 << 20)
        owner_ch.send(wire.ReadData(req="A", gen=offer.gen, ids=offer.ids, offset=0, length=total))
        assert owner_ch.recv(5).ok
        owner_data.settimeout(5)
        got = bytearray()
        while len(got) < total:
            got += owner_data.recv(1 << 20)
        assert len(got) == total and (np.frombuffer(bytes(got), np.uint8) == OLD).all()
        owner.close()
        thief.close()
    finally:
        producer.close()


@pytest.mark.timeout(60)
def test_an_address_that_drops_every_pull_connection_is_dialled_ever_less():
    """A fetching consumer names where the producer's pull connections go. Named an address that takes them
    and drops them (a third party's), the producer must not redial it twenty times a second for the session."""
    from kvxfer.transports.tcp.link import REDIALS

    layout = KVLayout.from_tensors([np.zeros((8, 2, 4, 1, 8), np.float16)], dims="BKNHD")
    victim = socket.create_server(("127.0.0.1", 0))
    dialled = []

    def drop_all():
        while True:
            try:
                s, _ = victim.accept()
            except OSError:
                return
            dialled.append(time.monotonic())
            s.close()

    threading.Thread(target=drop_all, daemon=True).start()
    producer = Producer(layout, transport="tcp", listen="127.0.0.1:0", transport_options={"streams": 1})
    try:
        peer = RawPeer(producer.address, timeout=10)
        peer.welcome(layout, f"127.0.0.1:{victim.getsockname()[1]}")  # not its own: a third party's
        time.sleep(3)
        assert 1 <= len(dialled) <= REDIALS + 1  # was some 60 in 3 s
        peer.close()
    finally:
        producer.close()
        victim.close()
