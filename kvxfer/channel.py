"""Framed messages over a stream socket: the edge where ``wire`` meets the network.

Also home of the socket helpers the TCP data path shares: address parsing, connecting with a deadline,
and scatter/gather I/O straight from and into registered memory.
"""

from __future__ import annotations

import socket
import threading
import time

from . import wire
from .errors import PeerError, ProtocolError, TimeoutError

IOV_MAX = 1024


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 as ``"[::1]:port"``) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]") or "127.0.0.1", int(port)


def connect(address: str, timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection(parse_address(address), timeout=timeout)
    except socket.timeout:
        raise TimeoutError(f"connecting to {address} timed out after {timeout:.1f}s") from None
    except OSError as e:
        raise PeerError(f"cannot connect to {address}: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
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
    while i < n:
        batch = views[i:i + IOV_MAX]
        i = _advance(views, i, batch, sock.sendmsg(batch))


def recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Scatter-receive exactly ``sum(len(v))`` bytes into ``views`` (registered memory)."""
    i, n = 0, len(views)
    while i < n:
        batch = views[i:i + IOV_MAX]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise PeerError("connection closed by peer mid-transfer")
        i = _advance(views, i, batch, got)


class Channel:
    """One framed, thread-safe-to-send connection."""

    CHUNK = 256 << 10  # a frame body is read in pieces of at most this: memory follows what has arrived

    def __init__(self, sock: socket.socket, max_frame: int = wire.MAX_FRAME):
        self.sock = sock
        self.max_frame = max_frame
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg) -> None:
        data = wire.encode(msg)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise PeerError(f"send failed: {e}") from None

    def recv(self, timeout: float | None = None, *, max_frame: int | None = None):
        """The next message; ``PeerError`` on EOF or socket error, ``ProtocolError`` on a bad frame.

        ``timeout`` bounds the whole message, header and body: a peer dribbling a byte at a time cannot hold
        the connection past it (``TimeoutError``). Without it each read waits up to the socket's own timeout.
        ``max_frame`` overrides the channel's limit for this message (a small one before the peer has
        authenticated). The body buffer grows with the bytes that arrive, never to the announced size at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            header = self._read(4, deadline)
            n = wire.frame_length(header, self.max_frame if max_frame is None else max_frame)
            body = self._read(n, deadline)
        except socket.timeout:
            raise TimeoutError("no whole message before the deadline") from None
        except OSError as e:
            raise PeerError(f"receive failed: {e}") from None
        return wire.decode(body)

    def _read(self, n: int, deadline: float | None) -> bytearray:
        buf = bytearray()
        while len(buf) < n:
            if deadline is not None:
                self.sock.settimeout(remaining(deadline))
            piece = self.sock.recv(min(n - len(buf), self.CHUNK))
            if not piece:
                raise PeerError("connection closed by peer")
            buf += piece
        return buf

    def request(self, msg, timeout: float, *, max_frame: int | None = None):
        """Send ``msg`` and wait for one answer (handshakes only; later traffic has a reader thread)."""
        self.send(msg)
        return self.recv(timeout, max_frame=max_frame)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


def remaining(deadline: float) -> float:
    """Seconds left before ``deadline`` (monotonic), raising ``TimeoutError`` when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
