import contextlib

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import ProtocolError, wire


def test_roundtrip_every_message():
    fp = wire.Fingerprint(
        version=1, dtype="bfloat16", block_size=16, num_layers=2, layer_bytes=8, block_bytes=16, order="16x8"
    )
    lay = wire.LayoutDesc(
        num_blocks=1,
        regions=[wire.RegionDesc(1, 2, -1)],
        seg_region=[0],
        seg_offset=[0],
        seg_stride=[16],
        seg_bytes=[16],
        fingerprint=fp,
    )
    msgs = [
        wire.Hello(version=1, peer_id="p", nonce=b"n" * 32),
        wire.Challenge(version=1, peer_id="c", nonce=b"m" * 32, proof=b"p" * 32),
        wire.Proof(proof=b"p" * 32, layout=lay, transports=[("nixl", b"meta"), ("tcp", b"")]),
        wire.Welcome(session=3, layout=lay, transport="tcp", mac=b"w" * 32),
        wire.Admit(req="r", num_blocks=2, deadline_ms=5, meta={"first_token": 1}),
        wire.Grant(req="r", gen=1, ids=wire.ids_to_bytes([1, 2])),
        wire.Busy(req="r", retry_after_ms=3),
        wire.Offer(req="r", gen=1, ids=b"", lease_ms=1),
        wire.Done(req="r", gen=1, nbytes=3),
        wire.Released(req="r", gen=1, nbytes=3),
        wire.Ack(req="r", gen=1),
        wire.Cancel(req="r", gen=1),
        wire.Error(req="r", code="x", message="y"),
        wire.DataHello(session=1),
        wire.WriteData(req="r", gen=1, ids=b"", offset=0, length=1),
        wire.ReadData(req="r", gen=1, ids=b"", offset=0, length=1),
        wire.DataReply(req="r", ok=True),
    ]
    for m in msgs:
        frame = wire.encode(m)
        assert wire.frame_length(frame[:4]) == len(frame) - 4
        assert wire.decode(frame[4:]) == m


def test_ids_pack():
    ids = np.array([0, 7, 2**32 - 1])
    assert wire.ids_from_bytes(wire.ids_to_bytes(ids)).tolist() == ids.tolist()
    with pytest.raises(ProtocolError):
        wire.ids_from_bytes(b"abc")


def test_frame_limits():
    with pytest.raises(ProtocolError, match="refused"):
        wire.frame_length(b"\xff\xff\xff\xff")
    with pytest.raises(ProtocolError):
        wire.frame_length(b"\x00\x00\x00\x00")
    with pytest.raises(ProtocolError, match="truncated"):
        wire.frame_length(b"\x00")


RELAXED = settings(suppress_health_check=[HealthCheck.too_slow], deadline=None, max_examples=200)


@RELAXED
@given(st.binary(max_size=200))
def test_untrusted_bytes_only_raise_protocol_errors(data):
    with contextlib.suppress(ProtocolError):
        wire.decode(data)


@RELAXED
@given(
    st.dictionaries(
        st.sampled_from(["t", "req", "gen", "ids", "nbytes", "x"]),
        st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=5), st.binary(max_size=5), st.none()),
    )
)
def test_untrusted_maps_only_raise_protocol_errors(obj):
    with contextlib.suppress(ProtocolError):
        wire.decode(msgspec.msgpack.encode(obj))


# ---- hostile input: nesting, numbers, meta --------------------------------------------------------------------
def _admit_with_meta_value(value: bytes) -> bytes:
    """An Admit body (tag first, as encode writes it) whose meta["k"] is the raw msgpack ``value``."""
    body = msgspec.msgpack.encode({"t": "admit", "req": "r", "num_blocks": 1, "deadline_ms": 1, "meta": {"k": None}})
    assert body.endswith(b"\xa1k\xc0")
    return body[:-1] + value


@pytest.mark.parametrize("depth", [950, 5000, 100_000])
def test_deeply_nested_meta_is_a_protocol_error(depth):
    body = _admit_with_meta_value(b"\x91" * depth + b"\x00")  # ~1 KB at 950: raised RecursionError
    with pytest.raises(ProtocolError, match="malformed"):
        wire.decode(body)


def test_deep_nesting_anywhere_is_a_protocol_error():
    deep = b"\x91" * 5000 + b"\x00"
    for body in (
        b"\x83\xa1x" + deep + b"\xa1t\xa3ack\xa3req\xa1r",  # before the tag: msgspec would skip it
        b"\x83\xa1t\xa3ack\xa3req\xa1r\xa1x" + deep,  # an unknown field
        b"\x82\xa1t\xa5hello\xa6layout" + deep,
    ):
        with pytest.raises(ProtocolError, match="malformed"):
            wire.decode(body)


def test_deep_nesting_in_a_session_thread_is_a_protocol_error():
    import threading

    out = []

    def run():
        try:
            wire.decode(_admit_with_meta_value(b"\x91" * 950 + b"\x00"))
        except ProtocolError as e:
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert len(out) == 1


def test_meta_is_a_bounded_json_like_dict():
    ok = {"num_tokens": 3, "sampling": {"temperature": 0.7, "stop": ["a", "b"], "seed": None}, "x": [[[1]]]}
    m = wire.Admit(req="r", num_blocks=1, deadline_ms=1, meta=ok)
    assert wire.decode(wire.encode(m)[4:]) == m
    for meta in (
        {"k": [[[[[1]]]]]},  # five containers below meta: one too deep
        {str(i): i for i in range(wire.META_ITEMS + 1)},
        {"k": list(range(wire.META_ITEMS + 1))},
        {"k": {1: 2}},
    ):  # keys are strings, as in JSON
        with pytest.raises(ProtocolError):
            wire.decode(wire.encode(wire.Admit(req="r", num_blocks=1, deadline_ms=1, meta=meta))[4:])


def test_a_message_whose_tag_is_not_first_is_refused():
    body = msgspec.msgpack.encode({"req": "r", "gen": 1, "t": "ack"})
    with pytest.raises(ProtocolError, match="tag"):
        wire.decode(body)


def _every_message():
    fp = wire.Fingerprint(
        version=2, dtype="bfloat16", block_size=16, num_layers=2, layer_bytes=8, block_bytes=16, order="L2 N16 D8"
    )
    lay = wire.LayoutDesc(
        num_blocks=1,
        regions=[wire.RegionDesc(1, 2, -1)],
        seg_region=[0],
        seg_offset=[0],
        seg_stride=[16],
        seg_bytes=[16],
        fingerprint=fp,
    )
    return [
        wire.Hello(version=1, peer_id="p", nonce=b"n" * 32),
        wire.Challenge(version=1, peer_id="c", nonce=b"m" * 32, proof=b"p" * 32),
        wire.Proof(proof=b"p" * 32, layout=lay, transports=[("tcp", b"")]),
        wire.Welcome(session=3, layout=lay, transport="tcp", mac=b"w" * 32),
        wire.Admit(req="r", num_blocks=2, deadline_ms=5, layers=[0]),
        wire.Grant(req="r", gen=1, ids=b""),
        wire.Busy(req="r", retry_after_ms=3),
        wire.Offer(req="r", gen=1, ids=b"", lease_ms=1),
        wire.Done(req="r", gen=1, nbytes=3),
        wire.Released(req="r", gen=1, nbytes=3),
        wire.Ack(req="r", gen=1),
        wire.Cancel(req="r", gen=1),
        wire.Error(req="r", code="x", message="y"),
        wire.DataHello(session=1),
        wire.WriteData(req="r", gen=1, ids=b"", offset=0, length=1),
        wire.ReadData(req="r", gen=1, ids=b"", offset=0, length=1),
        wire.DataReply(req="r", ok=True),
    ]


def _int_paths(obj, path=()):
    """Every integer inside a builtins tree, as a path of keys / indices."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int):
        yield path
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _int_paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _int_paths(v, (*path, i))


def _with(tree, path, value):
    import copy

    tree = copy.deepcopy(tree)
    node = tree
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return tree


def test_every_number_of_every_message_is_range_checked():
    """A negative count, length or offset (a data message with length -1 killed the TCP receiver), or one past
    what int64 arithmetic holds, is a ProtocolError at decode, before any code sees it."""
    checked = 0
    for m in _every_message():
        tree = msgspec.to_builtins(m, builtin_types=(bytes,))
        assert wire.decode(msgspec.msgpack.encode(tree)) == m  # only the changed number can make it fail
        for path in _int_paths(tree):
            region = path[-3:-1] == ("regions", 0)  # RegionDesc is [ptr, nbytes, device]
            low = -2 if region and path[-1] == 2 else -1  # device -1 is host memory
            wide = path[-1] == "session" or (region and path[-1] == 0)  # may use all 64 bits
            for bad in (low,) if wide else (low, 2**63):
                with pytest.raises(ProtocolError):
                    wire.decode(msgspec.msgpack.encode(_with(tree, path, bad)))
                checked += 1
    assert checked > 60


def test_a_write_of_negative_length_is_refused_at_decode():
    body = msgspec.msgpack.encode({"t": "write_data", "req": "r", "gen": 1, "ids": b"", "offset": 0, "length": -1})
    with pytest.raises(ProtocolError, match="length"):
        wire.decode(body)


def test_fuzz_short_run():
    """The CI-sized run of scripts/fuzz_wire.py (the full run tries >= 1M inputs): no untyped exception."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "fuzz_wire.py"), "--n", "20000", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "inputs tried: 20000 " in proc.stdout and "untyped exceptions: 0" in proc.stdout
    for gen in ("random_bytes", "mutate", "numbers", "structure", "deep", "frame_length"):
        assert f"{gen} " in proc.stdout, proc.stdout


# ---- at the edge: a real consumer answers hostile frames with an Error and keeps serving -----------------------
@pytest.fixture
def consumer():
    from kvxfer import Consumer, KVLayout

    dst = np.zeros((8, 4, 2, 8), np.uint8)
    with Consumer(KVLayout.from_tensors([dst], dims="BNHD"), transport="tcp", handshake_timeout=2.0) as c:
        c.dst = dst
        yield c


def _proof_tree(consumer, raw):
    """Open a handshake as ``raw`` and return a valid ``Proof`` for it as plain builtins, to corrupt."""
    from kvxfer import handshake

    hello, nonce = handshake.hello("raw")
    raw.send(hello)
    proof, _ = handshake.answer(raw.recv(), "consumer", "", nonce, consumer.layout, [("tcp", b"")])
    return msgspec.to_builtins(proof, builtin_types=(bytes,))


def _still_serves(consumer):
    from kvxfer import KVLayout, Producer

    src = np.arange(8 * 4 * 2 * 8, dtype=np.uint8).reshape(8, 4, 2, 8)
    with Producer(KVLayout.from_tensors([src], dims="BNHD"), transport="tcp") as p:
        p.push(consumer.address, "ok", [1, 2], deadline=10).wait()
    a = consumer.get(10)
    assert np.array_equal(consumer.dst[a.block_ids], src[[1, 2]])
    consumer.release(a.req)


def test_hostile_handshakes_get_an_error_frame_and_the_consumer_keeps_serving(consumer):
    from conformance.rawpeer import RawPeer

    def huge(tree):
        tree["layout"]["num_blocks"] = 2**64 - 1  # raised OverflowError: no Error frame
        return msgspec.msgpack.encode(tree)

    def stride(tree):
        tree["layout"]["seg_stride"] = [2**63]
        return msgspec.msgpack.encode(tree)

    def deep(tree):  # an unknown field: msgspec skipped it, recursing
        body = msgspec.msgpack.encode({**tree, "x": "@@@@"})
        return body.replace(b"\xa4@@@@", b"\x91" * 100_000 + b"\x00")

    for corrupt in (huge, stride, deep):  # each its own defect, in the frame that carries the layout
        raw = RawPeer(consumer.address)
        tree = _proof_tree(consumer, raw)
        assert isinstance(wire.decode(msgspec.msgpack.encode(tree)), wire.Proof)  # only the named part differs
        raw.send_frame(corrupt(tree))
        reply = raw.recv()
        assert isinstance(reply, wire.Error) and reply.code == "protocol", reply
        assert raw.closed_by_peer()
        raw.close()
    _still_serves(consumer)


def test_a_write_of_length_minus_one_ends_the_data_connection_cleanly(consumer, monkeypatch):
    import threading
    import time

    from conformance.rawpeer import RawPeer
    from kvxfer import handshake

    crashed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_type))
    ctl = RawPeer(consumer.address)
    welcome = ctl.hello(consumer.layout, "tcp")
    assert isinstance(welcome, wire.Welcome)
    data = RawPeer(consumer.address)
    data.send(handshake.data_hello(welcome.session, "push", ctl.key))
    data.send_frame(
        msgspec.msgpack.encode({"t": "write_data", "req": "r", "gen": 1, "ids": b"", "offset": 0, "length": -1})
    )  # killed the receiver thread with ValueError
    assert data.closed_by_peer()
    deadline = time.monotonic() + 5  # the receiver closes the socket before its thread has ended
    while any(t.name.endswith("serve_writes") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    data.close()
    ctl.close()
    assert crashed == []
    _still_serves(consumer)


@pytest.mark.parametrize("readers", [0, wire.MAX_READERS + 1, -1])
def test_a_fetch_for_no_readers_or_too_many_is_refused_at_decode(readers):
    body = msgspec.msgpack.encode({"t": "fetch", "req": "r", "num_blocks": 1, "readers": readers})
    with pytest.raises(ProtocolError, match="readers"):
        wire.decode(body)
    ok = msgspec.msgpack.encode({"t": "fetch", "req": "r", "num_blocks": 1, "readers": wire.MAX_READERS})
    assert wire.decode(ok).readers == wire.MAX_READERS
