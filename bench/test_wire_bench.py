"""Control-protocol encode / decode: the handshake, a 128k-token grant, data headers, block-id packing."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MILLION, fake_layout
from kvxfer import wire


@pytest.fixture(scope="module")
def proof():
    """The handshake message that carries the producer's layout and transport metadata."""
    layout = fake_layout(16384, layers=32)
    return wire.Proof(proof=b"p" * 32, layout=layout.desc(), transports=[("tcp", b"x" * 4096)])


def test_encode_proof(benchmark, proof):
    frame = benchmark(wire.encode, proof)
    assert len(frame) > 100


def test_decode_proof(benchmark, proof):
    body = wire.encode(proof)[4:]
    msg = benchmark(wire.decode, body)
    assert msg.layout.num_blocks == 16384


GRANT = wire.Grant(req="req-123", gen=7, ids=wire.ids_to_bytes(np.arange(8192)))
WRITE = wire.WriteData(req="req-123", gen=7, ids=wire.ids_to_bytes(np.arange(256)), offset=0, length=512 << 20)


@pytest.mark.parametrize("msg", [GRANT, WRITE, wire.Ack(req="req-123", gen=7)], ids=["grant-8192", "write-256", "ack"])
def test_roundtrip(benchmark, msg):
    def rt():
        return wire.decode(wire.encode(msg)[4:])

    assert benchmark(rt) == msg


def test_ids_to_bytes_1m(benchmark):
    ids = np.random.default_rng(0).permutation(MILLION)
    assert len(benchmark(wire.ids_to_bytes, ids)) == 4 * MILLION


def test_ids_from_bytes_1m(benchmark):
    b = wire.ids_to_bytes(np.arange(MILLION))
    assert len(benchmark(wire.ids_from_bytes, b, MILLION)) == MILLION
