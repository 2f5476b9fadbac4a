"""TLS on the control channel and TCP data connections: bytes arrive, nothing readable crosses, a wrong CA is
an AuthError, a plain producer against a TLS consumer fails in time."""

import time

import numpy as np
import pytest

from conformance.test_auth import Recorder
from kvxfer import AuthError, Consumer, KVLayout, KVXferError, Producer, tls
from kvxfer.bench import certs

PATTERN = np.frombuffer(b"KVXFER-PLAINTEXT", np.uint8)


def _cert(tmp_path, name: str) -> tuple[str, str]:
    """A self-signed certificate (and its key) for 127.0.0.1, as files."""
    cert_pem, key_pem = certs.self_signed(name=name)
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert.write_text(cert_pem)
    key.write_text(key_pem)
    return str(cert), str(key)


def _caches(fill):
    caches = [np.zeros((32, 4, 16, 64), np.uint8) for _ in range(2)]
    if fill:
        for c in caches:
            c.reshape(-1)[:] = np.resize(PATTERN, c.size)
    return caches, KVLayout.from_tensors(caches, dims="BHND")


@pytest.mark.parametrize("kind", ["push", "offer"])
def test_tls_moves_every_byte_and_nothing_readable_crosses(tmp_path, transport, kind):
    cert, key = _cert(tmp_path, "consumer")
    src, src_layout = _caches(True)
    dst, dst_layout = _caches(False)
    with Consumer(dst_layout, transport=transport, tls=tls.server_context(cert, key)) as c:
        relay = Recorder(c.address)
        with Producer(
            src_layout,
            transport=transport,
            tls=tls.client_context(cert),
            transport_options={"streams": 2, "window_min": 64 << 10},
        ) as p:
            ids = [3, 9, 1, 30]
            getattr(p, kind)(relay.address, "r", ids).wait(10)
            a = c.get(10)
            for s, d in zip(src, dst, strict=True):
                assert np.array_equal(d[a.block_ids], s[ids])
        seen = b"".join(bytes(x) for x in relay.up + relay.down)
        assert seen and PATTERN.tobytes() not in seen
        relay.close()


def test_a_consumer_the_producer_does_not_trust_is_an_auth_error(tmp_path, transport):
    cert, key = _cert(tmp_path, "consumer")
    other, _ = _cert(tmp_path, "someone-else")
    _, src_layout = _caches(True)
    _, dst_layout = _caches(False)
    with (
        Consumer(dst_layout, transport=transport, tls=tls.server_context(cert, key)) as c,
        Producer(src_layout, transport=transport, tls=tls.client_context(other)) as p,
        pytest.raises(AuthError),
    ):
        p.push(c.address, "r", [1]).wait(10)


def test_a_plain_producer_against_a_tls_consumer_fails_in_time(tmp_path, transport):
    cert, key = _cert(tmp_path, "consumer")
    _, src_layout = _caches(True)
    _, dst_layout = _caches(False)
    with (
        Consumer(dst_layout, transport=transport, tls=tls.server_context(cert, key), handshake_timeout=1.0) as c,
        Producer(src_layout, transport=transport, connect_timeout=2.0) as p,
    ):
        start = time.monotonic()
        with pytest.raises(KVXferError):
            p.push(c.address, "r", [1]).wait(10)
        assert time.monotonic() - start < 3.0
