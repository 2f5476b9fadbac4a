"""Bad input gets a clear, typed error; nothing is written outside granted blocks; the consumer survives."""

import numpy as np
import pytest

from kvxfer import handshake, wire

from .conftest import SENTINEL
from .kvspec import Spec, untouched
from .peers import PeerError
from .rawpeer import RawPeer


def _alive(consumer, producer, req="alive"):
    """The consumer still serves a well-behaved producer after the abuse."""
    producer.push(consumer.address, req, [0, 1])
    arrival = consumer.get(10)
    consumer.release(arrival.req)


@pytest.mark.parametrize(
    "ids,why", [([64], "out of range"), ([-1], "out of range"), ([3, 3], "duplicates"), ([], "empty")]
)
def test_bad_block_ids_are_refused_at_the_source(consumers, producers, ids, why):
    consumer = consumers()
    producer = producers()
    with pytest.raises(PeerError) as e:
        producer.push(consumer.address, "bad", ids)
    assert e.value.kind == "BlockError" and why in str(e.value)
    assert untouched(consumer.views, [], SENTINEL)


def test_more_blocks_than_the_consumer_has_is_busy(consumers, producers):
    consumer = consumers(Spec(num_blocks=64))
    producer = producers(Spec(num_blocks=128))
    with pytest.raises(PeerError) as e:
        producer.push(consumer.address, "big", np.arange(65))
    assert e.value.kind == "BusyError"
    assert consumer.stats()["free_blocks"] == 64


@pytest.mark.parametrize(
    "other", [Spec(dtype="float32"), Spec(heads=4), Spec(kind="hnd"), Spec(layers=2), Spec(block_size=8, head_dim=4)]
)
def test_incompatible_layouts_are_refused(consumers, producers, other):
    consumer = consumers(Spec())
    producer = producers(other)
    with pytest.raises(PeerError) as e:
        producer.push(consumer.address, "x", [1])
    assert e.value.kind == "IncompatibleError"
    assert untouched(consumer.views, [], SENTINEL)
    # the request the refused session was for has failed here, so that its waiter need not time out
    assert consumer.c.state("x") == "failed" and consumer.c.state("y") is None


def test_a_request_named_by_a_refused_session_fails_and_stays_failed(consumers, producers):
    """A refused session's request is over on the consumer: a compatible producer admitting it later is refused
    too, and a request nobody named is not touched."""
    consumer = consumers(Spec())
    with pytest.raises(PeerError):
        producers(Spec(dtype="float32")).push(consumer.address, "x", [1])
    good = producers()
    with pytest.raises(PeerError) as e:
        good.push(consumer.address, "x", [1])
    assert e.value.kind == "CancelledError"
    assert consumer.stats()["free_blocks"] == consumer.spec.num_blocks
    _alive(consumer, good)


def test_an_unproved_handshake_naming_a_request_fails_nothing(consumers, producers, transport):
    """Only a producer that proved the token can fail a request by naming it: a Proof with a made-up MAC (and a
    layout that does not pair) is refused as bad auth, and the request it names still goes through."""
    consumer = consumers()
    other = Spec(dtype="float32")
    raw = RawPeer(consumer.address)
    layout = other.layout(*other.build(fill=0)[:2])
    raw.send(handshake.hello("raw")[0])
    assert isinstance(raw.recv(), wire.Challenge)
    raw.send(wire.Proof(proof=bytes(32), layout=layout.desc(), transports=[(transport, b"")], req="victim"))
    reply = raw.recv()
    assert isinstance(reply, wire.Error) and reply.code == "auth", reply
    assert consumer.c.state("victim") is None
    _alive(consumer, producers(), req="victim")


def test_wrong_protocol_version(consumers, producers, transport):
    consumer = consumers()
    raw = RawPeer(consumer.address)
    reply = raw.hello(consumer.layout, transport, version=wire.VERSION + 1)
    assert isinstance(reply, wire.Error) and reply.code == "incompatible"
    assert raw.closed_by_peer()
    _alive(consumer, producers())


def test_wrong_auth(consumers, producers):
    consumer = consumers(auth="s3cret")
    with pytest.raises(PeerError) as e:
        producers(auth="guess").push(consumer.address, "x", [1])
    assert e.value.kind == "AuthError"
    _alive(consumer, producers(auth="s3cret"))


@pytest.mark.parametrize("garbage", [b"\xc1", b"\x81\xa1t\xa4nope", b"\x93\x01\x02\x03", b"\xff" * 64])
def test_malformed_frames(consumers, producers, garbage):
    consumer = consumers()
    raw = RawPeer(consumer.address)
    raw.send_frame(garbage)
    reply = raw.recv()
    assert isinstance(reply, wire.Error) and reply.code == "protocol"
    assert raw.closed_by_peer()
    _alive(consumer, producers())


def test_oversized_and_truncated_frames(consumers, producers):
    consumer = consumers()
    big = RawPeer(consumer.address)
    big.send_bytes(b"\xff\xff\xff\xff")
    reply = big.recv()
    assert isinstance(reply, wire.Error) and reply.code == "protocol" and "refused" in reply.message
    short = RawPeer(consumer.address)
    short.send_bytes(b"\x00\x00\x00\x64" + b"\x80" * 10)
    short.close()
    empty = RawPeer(consumer.address)
    empty.send_bytes(b"\x00\x00")
    empty.close()
    _alive(consumer, producers())


def test_garbage_after_handshake_releases_the_session(consumers, producers, transport):
    consumer = consumers()
    raw = RawPeer(consumer.address)
    assert isinstance(raw.hello(consumer.layout, transport), wire.Welcome)
    raw.send(wire.Admit(req="held", num_blocks=5, deadline_ms=10_000))
    assert isinstance(raw.recv(), wire.Grant)
    assert consumer.stats()["free_blocks"] == 59
    raw.send_frame(b"\x92\x01")
    reply = raw.recv()
    assert isinstance(reply, wire.Error) and reply.code == "protocol"
    assert raw.closed_by_peer()
    from .peers import wait_for

    wait_for(lambda: consumer.stats()["free_blocks"] == 64, 5)
    _alive(consumer, producers())


def test_stale_generation_and_wrong_length_are_refused(consumers, transport):
    consumer = consumers()
    raw = RawPeer(consumer.address)
    raw.hello(consumer.layout, transport)
    raw.send(wire.Admit(req="r", num_blocks=3, deadline_ms=10_000))
    grant = raw.recv()
    raw.send(wire.Done(req="r", gen=grant.gen + 1000, nbytes=3 * consumer.layout.block_bytes))
    stale = raw.recv()
    assert isinstance(stale, wire.Error) and stale.code == "stale"
    raw.send(wire.Done(req="r", gen=grant.gen, nbytes=7))
    short = raw.recv()
    assert isinstance(short, wire.Error) and short.code == "blocks"
    raw.send(wire.Done(req="nobody", gen=1, nbytes=7))
    assert raw.recv().code == "stale"
    raw.close()


def test_writing_outside_the_grant_is_refused(consumers, producers):
    consumer = consumers()
    producer = producers()
    # take blocks 0..9 first so the next grant is not what the producer will claim
    producer.push(consumer.address, "first", np.arange(10))
    held = consumer.get(10)
    with pytest.raises(PeerError) as e:
        producer.push(consumer.address, "sneaky", [20, 21], dst_block_ids=[0, 1])
    assert e.value.kind == "BlockError"
    assert untouched(consumer.views, held.block_ids, SENTINEL)
    from .peers import wait_for

    wait_for(lambda: consumer.stats()["inflight"] == 0 and consumer.stats()["free_blocks"] == 64 - 10, 5)


def test_answers_name_the_attempt_and_a_cancel_before_the_grant_frees_it(consumers, transport):
    from .peers import wait_for

    consumer = consumers()
    raw = RawPeer(consumer.address)
    raw.hello(consumer.layout, transport)
    raw.send(wire.Admit(req="a", num_blocks=4, deadline_ms=10_000, attempt=7))
    grant = raw.recv()
    assert isinstance(grant, wire.Grant) and grant.attempt == 7
    raw.send(wire.Admit(req="b", num_blocks=1000, deadline_ms=10_000, attempt=8))
    busy = raw.recv()
    assert isinstance(busy, wire.Busy) and busy.attempt == 8
    # the producer gave up on "c" before its grant arrived: a Cancel naming no generation releases it
    raw.send(wire.Admit(req="c", num_blocks=5, deadline_ms=10_000, attempt=9))
    raw.send(wire.Cancel(req="c", gen=0, reason="gave up"))
    wait_for(lambda: consumer.stats()["free_blocks"] == 64 - 4, 5)
    raw.close()


def test_a_meta_past_its_bound_is_refused_before_it_is_decoded(consumers, producers, transport):
    """Nested empty lists take one byte each on the wire and some 64 in memory once decoded: a meta is bounded
    by its bytes (``wire.META_BYTES``) before the message is decoded; the session ends as on any message the
    consumer cannot decode, and the consumer serves the next producer."""
    import resource

    import msgspec

    consumer = consumers()
    raw = RawPeer(consumer.address)
    assert isinstance(raw.hello(consumer.layout, transport), wire.Welcome)
    nested = msgspec.msgpack.encode({"x": [[[[[]] * 64] * 64] * 64] * 8})  # 2.1 MB of one-byte empty lists
    assert len(nested) > wire.META_BYTES
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    raw.send(wire.Admit(req="fat", num_blocks=1, deadline_ms=10_000, meta=msgspec.Raw(nested)))
    reply = raw.recv()
    assert isinstance(reply, wire.Error) and reply.code == "protocol" and "meta of" in reply.message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: nothing was decoded
    assert raw.closed_by_peer()
    _alive(consumer, producers())


@pytest.mark.parametrize("how", ["Admit", "Offer"])
def test_a_new_admission_of_an_active_id_tells_its_old_writer(consumers, transport, how):
    """docs/protocol.md: a new admission of a request id still active supersedes the old one, whose writers on
    other sessions are told ``Error(stale)`` at once, whether the new one is a push or an offer."""
    consumer = consumers()
    a, b = RawPeer(consumer.address), RawPeer(consumer.address)
    a.hello(consumer.layout, transport)
    b.hello(consumer.layout, transport)
    a.send(wire.Admit(req="victim", num_blocks=2, deadline_ms=10_000))
    assert isinstance(a.recv(), wire.Grant)
    if how == "Admit":
        b.send(wire.Admit(req="victim", num_blocks=2, deadline_ms=10_000))
    else:
        b.send(wire.Offer(req="victim", gen=1, ids=wire.ids_to_bytes([0, 1]), lease_ms=10_000))
    told = a.recv()
    assert isinstance(told, wire.Error) and told.code == "stale" and told.req == "victim"
    a.close()
    b.close()
