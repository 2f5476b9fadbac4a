"""Framed messages over a stream socket: the edge where ``wire`` meets the network.

The socket helpers the TCP data path shares (address parsing, connecting with a deadline, scatter/gather
I/O straight from and into registered memory) live in ``sockets``; they are re-exported here.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time

from . import wire
from .errors import DeadlineError, PeerError
from .sockets import IOV_MAX, connect, parse_address, recv_exact, recv_views, send_views  # noqa: F401

SEND_STALL = 5.0  # seconds a send may wait with no byte taken by the peer before the peer counts as gone
TLS_RECORD = 16 << 10  # what one TLS write sends at most


class Channel:
    """One framed, thread-safe-to-send connection."""

    CHUNK = 256 << 10  # a frame body is read in pieces of at most this: memory follows what has arrived

    def __init__(self, sock: socket.socket, max_frame: int = wire.MAX_FRAME, send_stall: float = SEND_STALL):
        self.sock = sock
        self.max_frame = max_frame
        self.send_stall = send_stall
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, *msgs) -> None:
        """Send ``msgs`` in one write (one system call, one wake-up of the peer).

        A peer that stops reading (stopped, hung) fills its socket buffers; a send then waits for room at most
        ``send_stall`` seconds without progress and fails with ``PeerError``, so no caller, reaper or session
        thread blocks forever on it (the caller drops the session: a frame may be half sent).
        """
        data = memoryview(b"".join(wire.encode(m) for m in msgs))
        with self._send_lock:
            try:
                self._send_all(data)
            except OSError as e:
                raise PeerError(f"send failed: {e}") from None

    def _send_all(self, data: memoryview) -> None:
        tls = isinstance(self.sock, ssl.SSLSocket)
        stall = time.monotonic() + self.send_stall
        while data:
            if tls:  # TLS takes no flags: wait for room, then write at most one record
                self._wait_writable(stall)
                n = self.sock.send(data[:TLS_RECORD])
            else:
                try:
                    n = self.sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    self._wait_writable(stall)
                    continue
            data = data[n:]
            stall = time.monotonic() + self.send_stall

    def _wait_writable(self, stall: float) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        left = stall - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise PeerError(f"the peer took no byte for {self.send_stall:g}s: it stopped reading")

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
