"""The handshake, written once for both sides: mutual proof of the shared token, then version, transport and
layout agreement. Plain functions over wire messages (sans-IO); ``producer`` and ``consumer`` drive them.

    producer -> Hello(version, peer_id, nonce_p)
    consumer -> Challenge(version, peer_id, nonce_c, proof_c = HMAC(token, "consumer" | nonce_p | nonce_c | id_c))
    producer -> Proof(proof_p = HMAC(token, "producer" | nonce_p | nonce_c | layout | transports [| req]), layout,
                      transports, req)
    consumer -> Welcome(session, layout, transport, meta, address,
                        mac = HMAC(key, "welcome" | session | layout | transport | meta | address))

with ``key = HMAC(token, "session" | nonce_p | nonce_c)``. Layouts pair when they mean the same bytes, or when
both declare which kv heads they hold (tensor-parallel shards of one cache): then over the heads they share; and
blocks of different tokens per block (one a multiple of the other) map through token positions (``paging``). The
token never crosses the wire; each side proves it over a nonce the other just chose, so a replayed message fails;
no layout (whose regions name raw addresses) and no transport metadata (a NIXL agent's whole registered region) is
revealed before both proofs held. Every data connection then proves the session key over a fresh nonce
(``DataHello``). An empty token is a token like any other: both sides must use it. A fetching consumer connects to
a producer's listening address instead; the producer still speaks first and the exchange is the same, the Welcome
naming the consumer's own listening ``address`` (where the producer's TCP data connections go).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

import msgspec

from . import wire
from .errors import AuthError, IncompatibleError, LayoutError, ProtocolError, from_code
from .layout import KVLayout
from .paging import Paging, paging

NONCE_BYTES = 32
_enc = msgspec.msgpack.Encoder()


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over length-prefixed parts, so no two different part lists hash the same bytes."""
    h = hmac.new(key, label, hashlib.sha256)
    for p in parts:
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.digest()


def _token(token: str) -> bytes:
    return token.encode()


def _check_nonce(n: bytes) -> None:
    if len(n) != NONCE_BYTES:
        raise ProtocolError(f"nonce of {len(n)} bytes, expected {NONCE_BYTES}")


def _version(v: int) -> None:
    if v != wire.VERSION:
        raise IncompatibleError(f"protocol version {v} != {wire.VERSION}")


def session_key(token: str, nonce_p: bytes, nonce_c: bytes) -> bytes:
    return _mac(_token(token), b"kvxfer-session", nonce_p, nonce_c)


def _remote_layout(desc: wire.LayoutDesc) -> KVLayout:
    try:
        return KVLayout.from_desc(desc)
    except LayoutError as e:
        raise ProtocolError(f"bad layout in handshake: {e}") from None


def _paging(a: KVLayout, b: KVLayout, local: KVLayout) -> Paging:
    """How producer layout ``a`` pairs with consumer layout ``b``; a packed local cache maps no tokens."""
    p = paging(a, b)
    if p.k > 1 and local.packed:
        raise IncompatibleError(
            f"this cache's blocks are packed by its attention kernel: blocks of {a.fingerprint.block_size} and "
            f"{b.fingerprint.block_size} tokens cannot be mapped into each other by tokens"
        )
    return p


# ---- producer side -----------------------------------------------------------------------------------------
def hello(peer_id: str) -> tuple[wire.Hello, bytes]:
    """The producer's opening message and the nonce it challenges with."""
    n = nonce()
    return wire.Hello(version=wire.VERSION, peer_id=peer_id, nonce=n), n


def answer(
    msg, address: str, token: str, nonce_p: bytes, layout: KVLayout, offers: list[tuple[str, bytes]], req: str = ""
) -> tuple[wire.Proof, bytes]:
    """Producer: check the consumer's ``Challenge``; returns our ``Proof`` (layout and transport offers, and the
    request ``req`` the session is opened for, if any) and the session key."""
    if isinstance(msg, wire.Error):
        raise from_code(msg.code, f"consumer {address} refused the handshake: {msg.message}")
    if not isinstance(msg, wire.Challenge):
        raise ProtocolError(f"expected challenge, got {type(msg).__name__}")
    _version(msg.version)
    _check_nonce(msg.nonce)
    expected = _mac(_token(token), b"kvxfer-consumer", nonce_p, msg.nonce, msg.peer_id.encode())
    if not hmac.compare_digest(expected, msg.proof):
        raise AuthError(f"consumer {address} could not prove the auth token")
    desc = layout.desc()
    proof = _mac(_token(token), b"kvxfer-producer", nonce_p, msg.nonce, *_proved(desc, offers, req))
    return wire.Proof(proof=proof, layout=desc, transports=offers, req=req), session_key(token, nonce_p, msg.nonce)


def _proved(desc: wire.LayoutDesc, offers: list, req: str) -> tuple[bytes, ...]:
    """What the producer's proof covers; a request named is one part more (a Proof naming none hashes as before)."""
    return (_enc.encode(desc), _enc.encode(offers), *((req.encode(),) if req else ()))


def check_welcome(
    msg, address: str, key: bytes, layout: KVLayout, offered: list[str]
) -> tuple[wire.Welcome, KVLayout, Paging]:
    """Producer: the consumer's ``Welcome`` is authentic, names a transport we offered and a layout we pair with
    (side ``a`` of the paging is ours)."""
    if isinstance(msg, wire.Error):
        raise from_code(msg.code, f"consumer {address} refused the handshake: {msg.message}")
    if not isinstance(msg, wire.Welcome):
        raise ProtocolError(f"expected welcome, got {type(msg).__name__}")
    if not hmac.compare_digest(_welcome_mac(key, msg), msg.mac):
        raise AuthError(f"consumer {address} sent a welcome not bound to this session")
    if msg.transport not in offered:
        raise IncompatibleError(f"consumer chose transport {msg.transport!r}, we offered {offered}")
    remote = _remote_layout(msg.layout)
    return msg, remote, _paging(layout, remote, layout)


# ---- consumer side -----------------------------------------------------------------------------------------
def check_hello(msg) -> wire.Hello:
    """Consumer: the first frame is a ``Hello`` of our protocol version."""
    if not isinstance(msg, wire.Hello):
        raise ProtocolError(f"expected hello, got {type(msg).__name__}")
    _version(msg.version)
    _check_nonce(msg.nonce)
    return msg


def challenge(hello_: wire.Hello, peer_id: str, token: str) -> tuple[wire.Challenge, bytes]:
    """Consumer: our challenge and our proof over the producer's nonce; returns it and our nonce."""
    n = nonce()
    proof = _mac(_token(token), b"kvxfer-consumer", hello_.nonce, n, peer_id.encode())
    return wire.Challenge(version=wire.VERSION, peer_id=peer_id, nonce=n, proof=proof), n


def check_proof(
    msg, token: str, nonce_p: bytes, nonce_c: bytes, layout: KVLayout, have: list[str]
) -> tuple[KVLayout, Paging, str, bytes, bytes]:
    """Consumer: the producer proved the token; returns its layout, the paging (side ``a`` the producer's), the
    first offered transport we have, its metadata, and the session key."""
    if isinstance(msg, wire.Error):  # a producer a fetching consumer connected to refused it
        raise from_code(msg.code, f"producer refused the handshake: {msg.message}")
    if not isinstance(msg, wire.Proof):
        raise ProtocolError(f"expected proof, got {type(msg).__name__}")
    expected = _mac(_token(token), b"kvxfer-producer", nonce_p, nonce_c, *_proved(msg.layout, msg.transports, msg.req))
    if not hmac.compare_digest(expected, msg.proof):
        raise AuthError("bad auth token")
    chosen = next(((name, meta) for name, meta in msg.transports if name in have), None)
    if chosen is None:
        raise IncompatibleError(f"producer offers transports {[n for n, _ in msg.transports]}, consumer has {have}")
    remote = _remote_layout(msg.layout)
    return remote, _paging(remote, layout, layout), chosen[0], chosen[1], session_key(token, nonce_p, nonce_c)


def welcome(session: int, layout: KVLayout, transport: str, meta: bytes, key: bytes, address: str = "") -> wire.Welcome:
    msg = wire.Welcome(session=session, layout=layout.desc(), transport=transport, transport_meta=meta, address=address)
    msg.mac = _welcome_mac(key, msg)
    return msg


def _welcome_mac(key: bytes, msg: wire.Welcome) -> bytes:
    return _mac(
        key,
        b"kvxfer-welcome",
        str(msg.session).encode(),
        _enc.encode(msg.layout),
        msg.transport.encode(),
        msg.transport_meta,
        msg.address.encode(),
    )


# ---- data connections --------------------------------------------------------------------------------------
def data_hello(session: int, purpose: str, key: bytes) -> wire.DataHello:
    """The first frame of a data connection of ``session``: a fresh nonce and the session key's proof over it."""
    n = nonce()
    return wire.DataHello(
        session=session,
        purpose=purpose,
        nonce=n,
        mac=_mac(key, b"kvxfer-data", str(session).encode(), purpose.encode(), n),
    )


def check_data_hello(msg: wire.DataHello, key: bytes, seen: set[bytes]) -> None:
    """Consumer: the data connection belongs to the session whose ``key`` this is, and its nonce is new
    (``seen`` holds that session's used nonces)."""
    _check_nonce(msg.nonce)
    expected = _mac(key, b"kvxfer-data", str(msg.session).encode(), msg.purpose.encode(), msg.nonce)
    if not hmac.compare_digest(expected, msg.mac):
        raise AuthError(f"data connection not proven for session {msg.session}")
    if msg.nonce in seen:
        raise AuthError(f"replayed data connection for session {msg.session}")
    seen.add(msg.nonce)
