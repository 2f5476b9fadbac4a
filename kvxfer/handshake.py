"""The handshake's checks, written once for both sides: version, auth, transport, layout compatibility.

Plain functions over wire messages (sans-IO): the producer builds a ``Hello`` and checks the ``Welcome``;
the consumer checks the ``Hello``. Each returns the peer's layout and the pairing of the two layouts,
or raises the typed error the other side is told.
"""

from __future__ import annotations

import hmac

from . import wire
from .errors import AuthError, IncompatibleError, LayoutError, ProtocolError, from_code
from .layout import KVLayout, check_compatible
from .plan import Pairing, pair


def token_ok(given: str, expected: str) -> bool:
    """Constant-time comparison of shared tokens."""
    return hmac.compare_digest(given.encode(), expected.encode())


def hello(peer_id: str, layout: KVLayout, transport: str, transport_meta: bytes, auth: str) -> wire.Hello:
    """The producer's opening message."""
    return wire.Hello(version=wire.VERSION, peer_id=peer_id, layout=layout.desc(), transport=transport,
                      transport_meta=transport_meta, auth=auth)


def _agree(version: int, transport: str, local_transport: str, other: str) -> None:
    if version != wire.VERSION:
        raise IncompatibleError(f"protocol version {version} != {wire.VERSION}")
    if transport != local_transport:
        raise IncompatibleError(f"{other} uses transport {transport!r}, this side {local_transport!r}")


def _remote_layout(desc: wire.LayoutDesc, local: KVLayout) -> KVLayout:
    try:
        remote = KVLayout.from_desc(desc)
    except LayoutError as e:
        raise ProtocolError(f"bad layout in handshake: {e}") from None
    check_compatible(local.fingerprint, remote.fingerprint)
    return remote


def check_hello(msg, layout: KVLayout, transport: str, auth: str) -> tuple[wire.Hello, KVLayout, Pairing]:
    """Consumer: the producer's ``Hello`` is acceptable; returns it, the producer's layout and the pairing
    (side ``a`` the producer's)."""
    if not isinstance(msg, wire.Hello):
        raise ProtocolError(f"expected hello, got {type(msg).__name__}")
    if msg.version != wire.VERSION:
        raise IncompatibleError(f"protocol version {msg.version} != {wire.VERSION}")
    if not token_ok(msg.auth, auth):
        raise AuthError("bad auth token")
    _agree(msg.version, msg.transport, transport, "producer")
    remote = _remote_layout(msg.layout, layout)
    return msg, remote, pair(remote, layout)


def check_welcome(msg, address: str, layout: KVLayout, transport: str) -> tuple[wire.Welcome, KVLayout, Pairing]:
    """Producer: the consumer's answer to our ``Hello`` is a ``Welcome`` we can work with."""
    if isinstance(msg, wire.Error):
        raise from_code(msg.code, f"consumer {address} refused the handshake: {msg.message}")
    if not isinstance(msg, wire.Welcome):
        raise ProtocolError(f"expected welcome, got {type(msg).__name__}")
    _agree(msg.version, msg.transport, transport, "consumer")
    remote = _remote_layout(msg.layout, layout)
    return msg, remote, pair(layout, remote)
