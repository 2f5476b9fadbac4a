import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer import ProtocolError, wire


def test_roundtrip_every_message():
    fp = wire.Fingerprint(version=1, dtype="bfloat16", block_size=16, num_layers=2, layer_bytes=8, block_bytes=16,
                          order="16x8")
    lay = wire.LayoutDesc(num_blocks=1, regions=[wire.RegionDesc(1, 2, -1)], seg_region=[0], seg_offset=[0],
                          seg_stride=[16], seg_bytes=[16], fingerprint=fp)
    msgs = [wire.Hello(version=1, peer_id="p", layout=lay, transport="tcp"),
            wire.Welcome(version=1, peer_id="c", session=3, layout=lay, transport="tcp"),
            wire.Admit(req="r", num_blocks=2, deadline_ms=5, meta={"first_token": 1}),
            wire.Grant(req="r", gen=1, ids=wire.ids_to_bytes([1, 2])), wire.Busy(req="r", retry_after_ms=3),
            wire.Offer(req="r", gen=1, ids=b"", lease_ms=1), wire.Done(req="r", gen=1, nbytes=3),
            wire.Released(req="r", gen=1, nbytes=3), wire.Ack(req="r", gen=1), wire.Cancel(req="r", gen=1),
            wire.Error(req="r", code="x", message="y"), wire.DataHello(session=1),
            wire.WriteData(req="r", gen=1, ids=b"", offset=0, length=1),
            wire.ReadData(req="r", gen=1, ids=b"", offset=0, length=1), wire.DataReply(req="r", ok=True)]
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
    try:
        wire.decode(data)
    except ProtocolError:
        pass


@RELAXED
@given(st.dictionaries(st.sampled_from(["t", "req", "gen", "ids", "nbytes", "x"]),
                       st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=5), st.binary(max_size=5), st.none())))
def test_untrusted_maps_only_raise_protocol_errors(obj):
    try:
        wire.decode(msgspec.msgpack.encode(obj))
    except ProtocolError:
        pass
