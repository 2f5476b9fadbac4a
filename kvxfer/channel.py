"""Framed messages over a stream socket: the edge where ``wire`` meets the network.

The socket helpers the TCP data path shares (address parsing, connecting with a deadline, scatter/gather
I/O straight from and into registered memory) live in ``sockets``; they are re-exported here.
"""

from __future__ import annotations

import socket
import threading
import time

from . import wire
from .sockets import IOV_MAX, connect, parse_address, recv_exact, recv_views, send_views  # noqa: F401
from .errors import PeerError, ProtocolError, TimeoutError

class Channel:
    """One framed, thread-safe-to-send connection. ``recv`` blocks up to the socket's timeout."""

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

    def recv(self, timeout: float | None = None):
        """The next message; ``PeerError`` on EOF or socket error, ``ProtocolError`` on a bad frame."""
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            header = recv_exact(self.sock, 4)
            body = recv_exact(self.sock, wire.frame_length(header, self.max_frame))
        except socket.timeout:
            raise TimeoutError("no message before the deadline") from None
        except OSError as e:
            raise PeerError(f"receive failed: {e}") from None
        return wire.decode(body)

    def request(self, msg, timeout: float):
        """Send ``msg`` and wait for one answer (handshakes only; later traffic has a reader thread)."""
        self.send(msg)
        return self.recv(timeout)

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
