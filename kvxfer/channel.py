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

import numpy as np

from . import _kvx, wire
from .errors import ConfigError, DeadlineError, PeerError
from .sockets import IOV_MAX, connect, parse_address, recv_exact, recv_views, send_views  # noqa: F401

SEND_STALL = 5.0  # seconds a send may wait with no byte taken by the peer before the peer counts as gone
TLS_RECORD = 16 << 10  # what one TLS write sends at most
SPIN = 100e-6  # seconds a reader busy-waits for the next message before it blocks (0: never)


class Spin:
    """When a reader busy-waits before it blocks: up to ``limit`` after each message it received and after each
    one its channel sent (whose answer it then takes at once). Spinning pays where waking a blocked thread costs
    more than the round trip, as waking an idle core of a virtual machine does (docs/performance.md). A reader
    whose spins keep failing on long waits (an idle connection) stops spinning after ``IDLE_AFTER`` of them,
    until a message comes soon again or the channel sends one."""

    IDLE_AFTER = 8

    def __init__(self, limit: float = SPIN):
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit <= 0.01:
            raise ConfigError(f"spin must be 0 to 0.01 seconds, got {limit!r}")
        self.limit = limit
        self.misses = 0
        self.until = np.zeros(1, np.int64)  # monotonic ns the reader spins to; a send moves it on

    def start(self, now_ns: int) -> bool:
        """Before a read: whether to spin, and to when."""
        if self.limit and self.misses < self.IDLE_AFTER:
            self.until[0] = max(int(self.until[0]), now_ns + int(self.limit * 1e9))
        return bool(self.until[0] > now_ns)

    def sent(self, now_ns: int) -> None:
        if self.limit:
            self.until[0] = max(int(self.until[0]), now_ns + int(self.limit * 1e9))

    def took(self, waited: float | None) -> None:
        """A message came: during the spin (``None``), or ``waited`` seconds after the reader blocked."""
        self.misses = 0 if waited is None or waited <= self.limit else self.misses + 1


class Channel:
    """One framed, thread-safe-to-send connection."""

    CHUNK = 256 << 10  # a frame body is read in pieces of at most this: memory follows what has arrived

    def __init__(
        self, sock: socket.socket, max_frame: int = wire.MAX_FRAME, send_stall: float = SEND_STALL, spin: float = SPIN
    ):
        self.sock = sock
        self.max_frame = max_frame
        self.send_stall = send_stall
        self.spin = Spin(spin)
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, *msgs) -> None:
        """Send ``msgs`` in one write (one system call, one wake-up of the peer).

        A peer that stops reading (stopped, hung) fills its socket buffers; a send then waits for room at most
        ``send_stall`` seconds without progress and fails with ``PeerError``, so no caller, reaper or session
        thread blocks forever on it (the caller drops the session: a frame may be half sent).
        """
        data = memoryview(b"".join(map(wire.encode, msgs)))
        with self._send_lock:
            try:
                self._send_all(data)
            except OSError as e:
                raise PeerError(f"send failed: {e}") from None
        self.spin.sent(time.monotonic_ns())  # its answer is due: the reader spins for it

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
            blocked = self._spin()
            header = self._read(4, deadline)
            self.spin.took(None if blocked is None else time.monotonic() - blocked)
            n = wire.frame_length(header, self.max_frame if max_frame is None else max_frame)
            body = self._read(n, deadline)
        except TimeoutError:
            raise DeadlineError("no whole message before the deadline") from None
        except OSError as e:
            raise PeerError(f"receive failed: {e}") from None
        return wire.decode(body)

    def _spin(self) -> float | None:
        """Busy-wait for the next message while the spin lasts; ``None`` if it came (or TLS holds one already),
        else when the blocking read begins."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return None
        fd = self.sock.fileno()
        if fd >= 0 and self.spin.start(time.monotonic_ns()) and _kvx.spin_readable(fd, self.spin.until):
            return None
        return time.monotonic()

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
