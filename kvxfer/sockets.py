"""The socket edge: the one place an OS error becomes a kvxfer error; address parsing, connecting with a
deadline, scatter/gather I/O straight from and into registered memory, and teardown that cannot fail.

Everything above this module (channels, the TCP transport, the handles) sees only ``KVXferError``s: a timeout
is a ``DeadlineError``, a reset, refused or closed connection a ``PeerError``, any other OS failure a
``TransportError``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from . import _kvx
from .errors import AuthError, ConfigError, DeadlineError, KVXferError, PeerError, TransportError

IOV_MAX = 1024
log = logging.getLogger("kvxfer")


def translate(e: OSError, what: str) -> KVXferError:
    """The kvxfer error an OS error means, for a failure while ``what``."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return AuthError(f"{what}: {e.verify_message or e}")
    if isinstance(e, ssl.SSLError):
        return PeerError(f"{what}: TLS failed: {e.reason or e}")
    if isinstance(e, socket.timeout):
        return DeadlineError(f"{what}: timed out")
    if isinstance(e, (ConnectionError, EOFError)):
        return PeerError(f"{what}: {e.strerror or e}")
    return TransportError(f"{what}: {e.strerror or e}")


@contextmanager
def mapped(what: str) -> Iterator[None]:
    """Run a block of socket calls; OS errors leave it as kvxfer errors."""
    try:
        yield
    except OSError as e:
        raise translate(e, what) from None


def shutdown(sock: socket.socket) -> None:
    """Stop both directions now (a blocked ``sendmsg`` / ``recvmsg_into`` returns); a dead socket is fine."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def listen(where: tuple[str, int]) -> socket.socket:
    """A socket listening on ``where``; ``ConfigError`` when this host cannot (the port is taken, the address
    is not one of this host's)."""
    try:
        return socket.create_server(where, backlog=128)
    except OSError as e:
        raise ConfigError(f"cannot listen on {where[0]}:{where[1]}: {e.strerror or e}") from None


# accept() failures that say nothing about the listener: out of descriptors or memory (for now), a connection
# reset before it was taken
_PASSING = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO, errno.EPERM}
ACCEPT_BACKOFF = 0.1  # seconds an accept loop waits after running out of descriptors, before it tries again


def accept(listener: socket.socket, closed) -> tuple[socket.socket, str] | None:
    """The next connection on ``listener`` and its peer's host; None once ``closed()`` or the listener is gone.
    A peer that used up this process's descriptors (many connections at once) stalls the loop for a moment;
    it never ends it, which would leave the handle deaf for good."""
    while not closed():
        try:
            sock, addr = listener.accept()
            return sock, addr[0]
        except OSError as e:
            if e.errno not in _PASSING:
                return None
            log.warning("kvxfer: accept on %s failed (%s); trying again", listener.getsockname(), e.strerror or e)
            time.sleep(ACCEPT_BACKOFF)
    return None


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) -> (host, port); anything else is a ``ConfigError``."""
    if not isinstance(address, str):
        raise ConfigError(f"address {address!r} is not a 'host:port' string")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536 or any(c.isspace() for c in address):
        raise ConfigError(f"address {address!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def connect(address: str, timeout: float, tls: ssl.SSLContext | None = None) -> socket.socket:
    """A connected TCP socket (no Nagle) to ``address`` within ``timeout`` seconds; TLS with ``tls``."""
    where = parse_address(address)
    start = time.monotonic()
    try:
        sock = socket.create_connection(where, timeout=timeout)
    except TimeoutError:
        raise DeadlineError(f"connecting to {address} timed out after {timeout:.1f}s") from None
    except OSError as e:
        raise PeerError(f"cannot connect to {address}: {e.strerror or e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return sock
    try:
        with mapped(f"TLS handshake with {address}"):
            sock.settimeout(max(0.05, timeout - (time.monotonic() - start)))
            return tls.wrap_socket(sock, server_hostname=where[0])
    except KVXferError:
        close(sock)
        raise


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    with mapped("receiving"):
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PeerError("connection closed by peer")
            got += k
    return bytes(buf)


def _advance(views: list[memoryview], i: int, batch: list[memoryview], k: int) -> int:
    """Skip ``k`` transferred bytes of ``batch`` (starting at ``views[i]``); returns the new index."""
    for v in batch:
        if k >= len(v):
            k -= len(v)
            i += 1
        else:
            views[i] = v[k:]
            break
    return i


def send_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Gather-send every byte of ``views`` (registered memory), handling partial sends."""
    i, n = 0, len(views)
    with mapped("sending data"):
        if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg: one record stream, piece by piece
            for v in views:
                sock.sendall(v)
            return
        while i < n:
            batch = views[i : i + IOV_MAX]
            i = _advance(views, i, batch, sock.sendmsg(batch))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-receive exactly ``sum(len(v))`` bytes into ``views`` (registered memory)."""
    i, n = 0, len(views)
    with mapped("receiving data"):
        if isinstance(sock, ssl.SSLSocket):  # TLS has no recvmsg_into: fill each piece in turn
            for v in views:
                got = 0
                while got < len(v):
                    k = sock.recv_into(v[got:])
                    if k == 0:
                        raise PeerError("connection closed by peer mid-transfer")
                    got += k
            return
        while i < n:
            batch = views[i : i + IOV_MAX]
            got = sock.recvmsg_into(batch)[0]
            if got == 0:
                raise PeerError("connection closed by peer mid-transfer")
            i = _advance(views, i, batch, got)


def _timeout_ms(sock: socket.socket) -> int:
    t = sock.gettimeout()
    return -1 if t is None else max(1, int(t * 1000))


def send_extents(sock: socket.socket, bases: np.ndarray, sizes: np.ndarray, region, offset, nbytes) -> None:
    """Gather-send extents (region index, offset, length) of host regions at ``bases`` (``sizes`` bytes each)
    in native code, without the GIL and without a Python object per piece. Not for TLS sockets."""
    with mapped("sending data"):
        _kvx.sendv(sock.fileno(), bases, sizes, region, offset, nbytes, _timeout_ms(sock))


def recv_extents(sock: socket.socket, bases: np.ndarray, sizes: np.ndarray, region, offset, nbytes) -> None:
    """Scatter-receive exactly the extents' bytes (see ``send_extents``)."""
    with mapped("receiving data"):
        try:
            _kvx.recvv(sock.fileno(), bases, sizes, region, offset, nbytes, _timeout_ms(sock))
        except EOFError:
            raise PeerError("connection closed by peer mid-transfer") from None
