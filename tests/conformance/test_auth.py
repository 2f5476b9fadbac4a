"""Authentication and per-peer limits, tried as an eavesdropper, a replaying attacker or a flooding peer would."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from kvxfer import AuthError, ConfigError, Consumer, Producer, handshake, wire
from kvxfer.channel import Channel, parse_address

from .conftest import SENTINEL
from .kvspec import Spec
from .peers import wait_for
from .rawpeer import RawPeer

TOKEN = "correct horse battery staple"


class Recorder:
    """A TCP relay in front of a consumer that keeps every byte each way, for one connection at a time."""

    def __init__(self, target: str):
        self.target = parse_address(target)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.up: list[bytes] = []  # producer -> consumer, per connection
        self.down: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            up, down = bytearray(), bytearray()
            self.up.append(up)
            self.down.append(down)
            for src, dst, log in ((a, b, up), (b, a, down)):
                threading.Thread(target=self._pipe, args=(src, dst, log), daemon=True).start()

    @staticmethod
    def _pipe(src, dst, log: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                log += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def frames(self, stream: bytes) -> list[bytes]:
        out, i = [], 0
        while i + 4 <= len(stream):
            n = int.from_bytes(stream[i : i + 4], "big")
            out.append(stream[i + 4 : i + 4 + n])
            i += 4 + n
        return out

    def close(self) -> None:
        self.server.close()


def test_token_never_crosses_the_wire(consumers, producers):
    consumer = consumers(auth=TOKEN)
    relay = Recorder(consumer.address)
    producer = producers(auth=TOKEN)
    assert producer.push(relay.address, "r", [1, 2, 3])["status"] == "done"
    assert consumer.get(10).req == "r"
    seen = b"".join(bytes(x) for x in relay.up + relay.down)
    assert seen and TOKEN.encode() not in seen
    relay.close()


def test_replayed_handshake_is_refused(consumers, producers, transport):
    consumer = consumers(auth=TOKEN)
    relay = Recorder(consumer.address)
    assert producers(auth=TOKEN).push(relay.address, "r", [1])["status"] == "done"
    hello, proof = relay.frames(bytes(relay.up[0]))[:2]
    assert isinstance(wire.decode(hello), wire.Hello) and isinstance(wire.decode(proof), wire.Proof)
    raw = RawPeer(consumer.address)
    raw.send_frame(hello)
    assert isinstance(raw.recv(), wire.Challenge)  # a fresh challenge: the old proof answers another nonce
    raw.send_frame(proof)
    reply = raw.recv()
    assert isinstance(reply, wire.Error) and reply.code == "auth"
    assert raw.closed_by_peer()
    relay.close()


def test_nothing_about_memory_before_both_proofs(consumers, transport):
    consumer = consumers(auth=TOKEN)
    relay = Recorder(consumer.address)
    raw = RawPeer(relay.address)
    reply = raw.hello(consumer.layout, transport, auth="guess")
    assert isinstance(reply, wire.Error) and reply.code == "auth"
    assert raw.closed_by_peer()
    said = [wire.decode(f) for f in relay.frames(bytes(relay.down[0]))]
    assert [type(m) for m in said] == [wire.Challenge, wire.Error]  # no Welcome: no layout, no transport metadata
    relay.close()


def test_a_consumer_that_cannot_prove_the_token_learns_nothing(transport):
    spec = Spec()
    tensors, kw, _, _ = spec.build(seed=1)
    producer = Producer(spec.layout(tensors, kw), transport=transport, auth=TOKEN, connect_timeout=2.0)
    server = socket.create_server(("127.0.0.1", 0))
    got: list[object] = []

    def fake_consumer():
        conn, _ = server.accept()
        ch = Channel(conn)
        got.append(ch.recv(5))
        fake, _ = handshake.challenge(got[0], "fake", "guess")
        ch.send(fake)
        conn.settimeout(2)
        try:
            got.append(conn.recv(1 << 16))
        except OSError:
            got.append(b"")
        ch.close()

    th = threading.Thread(target=fake_consumer, daemon=True)
    th.start()
    with pytest.raises(AuthError):
        producer.push(f"127.0.0.1:{server.getsockname()[1]}", "r", [1]).wait(10)
    th.join(5)
    producer.close()
    server.close()
    assert isinstance(got[0], wire.Hello) and got[1] == b""  # no Proof, so no layout and no NIXL metadata


def test_data_connections_prove_the_session_key_once(consumers, transport):
    consumer = consumers(auth=TOKEN)
    raw = RawPeer(consumer.address)
    welcome = raw.hello(consumer.layout, transport, auth=TOKEN)
    assert isinstance(welcome, wire.Welcome) and consumer.stats()["sessions"] == 1
    forged = handshake.data_hello(welcome.session, "push", b"not the key")
    good = handshake.data_hello(welcome.session, "push", raw.key)
    streams = transport == "tcp"  # a one-sided transport has no data connections: even a proven one is closed
    for msg, accepted in ((forged, False), (good, streams), (good, False)):  # the last: the same nonce replayed
        conn = RawPeer(consumer.address)
        conn.send(msg)
        if accepted:
            assert not conn.closed_by_peer()
        else:
            assert conn.closed_by_peer()
        conn.close()
    raw.close()


def test_allowed_producers_and_per_host_sessions(transport):
    spec = Spec()
    tensors, kw, _, _ = spec.build(fill=SENTINEL)
    layout = spec.layout(tensors, kw)
    with pytest.raises(ConfigError):
        Consumer(layout, transport=transport, allowed_producers=["not an address"])
    elsewhere = Consumer(layout, transport=transport, allowed_producers=["10.0.0.0/8"])
    assert RawPeer(elsewhere.address).closed_by_peer()
    elsewhere.close()
    few = Consumer(layout, transport=transport, max_sessions_per_host=2, handshake_timeout=3.0)
    held = [RawPeer(few.address) for _ in range(2)]
    time.sleep(0.2)
    assert RawPeer(few.address, timeout=1.0).closed_by_peer()
    for r in held:
        r.close()

    def room_again() -> bool:
        probe = RawPeer(few.address, timeout=0.3)
        try:
            return not probe.closed_by_peer()
        finally:
            probe.close()

    wait_for(room_again, 5)
    few.close()


def test_admissions_per_producer_are_bounded(consumers, transport):
    consumer = consumers(max_inflight_per_peer=2)
    raw = RawPeer(consumer.address)
    raw.hello(consumer.layout, transport)
    for i in range(2):
        raw.send(wire.Admit(req=f"a{i}", num_blocks=1, deadline_ms=10_000, attempt=i + 1))
        assert isinstance(raw.recv(), wire.Grant)
    raw.send(wire.Admit(req="a2", num_blocks=1, deadline_ms=10_000, attempt=3))
    assert isinstance(raw.recv(), wire.Busy)
    other = RawPeer(consumer.address)
    other.hello(consumer.layout, transport)
    other.send(wire.Admit(req="b", num_blocks=1, deadline_ms=10_000, attempt=1))
    assert isinstance(other.recv(), wire.Grant)  # another producer is not starved by the first
    raw.close()
    other.close()


def test_control_message_flood_ends_the_session(consumers, producers, transport):
    consumer = consumers(max_msgs_per_sec=200)
    raw = RawPeer(consumer.address)
    raw.hello(consumer.layout, transport)
    frame = wire.encode(wire.Cancel(req="nobody", gen=1, reason="flood"))
    raw.send_bytes(frame * 2000)
    reply = raw.recv()
    assert isinstance(reply, wire.Error) and reply.code == "protocol" and "a second" in reply.message
    assert raw.closed_by_peer()
    assert producers().push(consumer.address, "after", [1])["status"] == "done"
