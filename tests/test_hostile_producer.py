"""A producer a consumer fetches from, spoken by hand: the session the consumer opened to fetch carries that
fetch's offer and nothing else. A push on it would put requests into the consumer's allocator from a peer its
``allowed_producers`` never admitted."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvxfer import Consumer, KVLayout, handshake, transports, wire
from kvxfer.channel import Channel


def _layout():
    return KVLayout.from_tensors([np.zeros((16, 2, 16, 2, 64), np.float16) for _ in range(2)], dims="BKNHD")


def _serve_one(server: socket.socket, layout: KVLayout, script) -> threading.Thread:
    """A producer by hand: the handshake of a fetching consumer's session, then ``script(ch, fetch)``."""

    def run():
        sock, _ = server.accept()
        ch = Channel(sock)
        opening, nonce = handshake.hello("hostile")
        ch.send(opening)
        challenge = ch.recv(10)
        mine = transports.get("tcp")(layout, host=None)
        proof, _ = handshake.answer(challenge, "c", "", nonce, layout, [("tcp", mine.local_meta())])
        ch.send(proof)
        ch.recv(10)  # Welcome
        script(ch, ch.recv(10))
        threading.Event().wait(1)
        mine.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(60)
def test_the_producer_a_consumer_fetches_from_cannot_push_into_it():
    layout = _layout()
    server = socket.create_server(("127.0.0.1", 0))
    seen: list = []

    def script(ch, fetch):
        ch.send(wire.Admit(req="injected", num_blocks=2, deadline_ms=5000, data=b"\x42" * (2 * layout.block_bytes)))
        seen.append(ch.recv(10))
        ch.send(wire.Error(req=fetch.req, code="stale", message="no such hold"))

    thread = _serve_one(server, layout, script)
    with Consumer(layout, transport="tcp", allowed_producers=["10.0.0.0/8"]) as c:
        free = c.allocator.num_free
        f = c.fetch(f"127.0.0.1:{server.getsockname()[1]}", "wanted", [5, 6], deadline=5)
        with pytest.raises(Exception):  # noqa: B017 - the hold's own refusal, whichever it is
            f.wait(10)
        thread.join(10)
        assert isinstance(seen[0], wire.Error) and seen[0].req == "injected"
        assert c.stats()["handed"] == 0 and c.arrivals.empty()
        assert c.allocator.num_free == free
    server.close()


@pytest.mark.timeout(60)
def test_a_fetch_the_producer_confirms_late_but_within_the_verdict_wait_succeeds():
    """After its Released a read waits ``VERDICT_WAIT`` past its deadline for the producer's Ack (whether the
    lease held is the producer's to say): the caller's ``wait`` must not give up earlier and call it failed."""
    layout = _layout()
    server = socket.create_server(("127.0.0.1", 0))

    def script(ch, fetch):
        data = b"\x01" * (2 * layout.block_bytes)
        ch.send(wire.Offer(req=fetch.req, gen=5, ids=wire.ids_to_bytes([0, 1]), lease_ms=60_000, data=data))
        assert isinstance(ch.recv(10), wire.Released)
        # past the fetch's deadline by a second, within VERDICT_WAIT, however long a loaded machine took to get here
        threading.Event().wait(max(0.0, ack_at[0] - time.monotonic()))
        ch.send(wire.Ack(req=fetch.req, gen=5))

    deadline = 2.0  # room for the Offer and its Released to cross before it, on a loaded machine too
    ack_at = []
    thread = _serve_one(server, layout, script)
    with Consumer(layout, transport="tcp") as c:
        ack_at.append(time.monotonic() + deadline + 1.0)
        f = c.fetch(f"127.0.0.1:{server.getsockname()[1]}", "late", [5, 6], deadline=deadline)
        f.wait(30)
        assert f.error is None
        thread.join(10)
    server.close()


def test_admits_naming_ever_new_layer_subsets_do_not_grow_the_session():
    """Each layer subset a part names costs a paging, cached per session: a peer naming a new one in every
    Admit (32 layers have 2**32 subsets; refused Admits count too) finds the cache bounded."""
    from conformance.rawpeer import RawPeer
    from kvxfer.transports.base import SELECTIONS

    layers = 8
    layout = KVLayout.from_tensors([np.zeros((16, 2, 4, 1, 8), np.float16) for _ in range(layers)], dims="BKNHD")
    with Consumer(layout, transport="tcp") as c:
        raw = RawPeer(c.address, timeout=10)
        raw.hello(layout, "tcp")
        link = next(iter(c._sessions.values())).link
        for mask in range(1, 2**layers):
            raw.send(
                wire.Admit(req="x", num_blocks=1, deadline_ms=1000, layers=[i for i in range(layers) if mask >> i & 1])
            )
            raw.recv()
        assert len(link.__dict__.get("_selected", {})) <= SELECTIONS
        raw.close()


def test_a_grant_written_in_many_small_windows_plans_its_blocks_once(monkeypatch):
    """A window of one byte must not cost the extents of the whole grant: with a peer layout cut into tiny
    segments that was seconds and hundreds of MB per WriteData. The grant's extents are made once."""
    from conformance.rawpeer import RawPeer
    from kvxfer.transports.tcp.link import TcpLink

    layout = _layout()
    made = []
    plan = TcpLink._extents
    monkeypatch.setattr(TcpLink, "_extents", lambda self, *a, **k: made.append(1) or plan(self, *a, **k))
    with Consumer(layout, transport="tcp") as c:
        raw = RawPeer(c.address, timeout=10)
        welcome = raw.hello(layout, "tcp")
        raw.send(wire.Admit(req="many", num_blocks=4, deadline_ms=10_000))
        grant = raw.recv()
        data = RawPeer(c.address, timeout=10)
        data.send(handshake.data_hello(welcome.session, "push", raw.key))
        total, step = 4 * layout.block_bytes, layout.block_bytes // 4
        for offset in range(0, total, step):
            data.send(wire.WriteData(req="many", gen=grant.gen, ids=grant.ids, offset=offset, length=step))
            data.send_bytes(bytes([offset // step]) * step)
            assert data.recv().ok
        raw.send(wire.Done(req="many", gen=grant.gen, nbytes=total))
        assert isinstance(raw.recv(), wire.Ack)
        assert len(made) == 1
        raw.close()
        data.close()
