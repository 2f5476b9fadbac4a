"""Framed messages over a stream socket: the edge where ``wire`` meets the network.

The socket helpers the TCP data path shares (address parsing, connecting with a deadline, scatter/gather
I/O straight from and into registered memory) live in ``sockets``; they are re-exported here.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from . import wire
from .errors import DeadlineError, PeerError
from .sockets import IOV_MAX, connect, parse_address, recv_exact, recv_views, send_views  # noqa: F401


class Channel:
    """One framed, thread-safe-to-send connection."""

    CHUNK = 256 << 10  # a frame body is read in pieces of at most this: memory follows what has arrived

    def __init__(self, sock: socket.socket, max_frame: int = wire.MAX_FRAME):
        self.sock = sock
        self.max_frame = max_frame
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, *msgs) -> None:
        """Send ``msgs`` in one write (one system call, one wake-up of the peer)."""
        data = b"".join(wire.encode(m) for m in msgs)
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError as e:
                raise PeerError(f"send failed: {e}") from None

    def recv(self, timeout: float | None = None, *, max_frame: int | None = None):
        """The next message; ``PeerError`` on EOF or socket error, ``ProtocolError`` on a bad frame.

        ``timeout`` bounds the whole message, header and body: a peer dribbling a byte at a time cannot hold
        the connection past it (``DeadlineError``). Without it each read waits up to the socket's own timeout.
        ``max_frame`` overrides the channel's limit for this message (a small one before the peer has
        authenticated). The body buffer grows with the bytes that arrive, never to the announced size at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            header = self._read(4, deadline)
            n = wire.frame_length(header, self.max_frame if max_frame is None else max_frame)
            body = self._read(n, deadline)
        except TimeoutError:
            raise DeadlineError("no whole message before the deadline") from None
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
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def remaining(deadline: float) -> float:
    """Seconds left before ``deadline`` (monotonic), raising ``DeadlineError`` when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineError("deadline passed")
    return left
