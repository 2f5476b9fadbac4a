"""The data connections of one TCP link: pooled, dialled on demand up to ``streams``, closed with the link.

A connection a mover holds is only shut down when the link closes, never closed under it: the native movers
(``_kvx.sendv`` / ``recvv``) work on the raw descriptor number for a whole window, and a number closed under them
can be reused at once by another socket, pipe or file, which their next call would then write into or read
from. The shutdown stops the move (its next call fails); the mover closes the connection when it lets go.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ...channel import Channel
from ...errors import PeerError, ProtocolError
from ...sockets import shutdown

POLL = 0.25  # how often a wait for a free connection looks at cancel / deadline
MAX_OPEN = 256  # data connections one link keeps open at most: a peer opening more is refused the rest


class Connections:
    """Push connections the producer dials (at most ``streams`` open) and pull connections the producer opened
    for the consumer to read through; a connection that failed mid-transfer is dropped, never reused."""

    def __init__(self, dial: Callable[[str], Channel], streams: int):
        self.dial = dial
        self.streams = streams
        self.pushes: queue.Queue[Channel] = queue.Queue()
        self.pulls: queue.Queue[Channel] = queue.Queue()
        self.open_pushes = 0
        self.closed = False
        self._open: set[Channel] = set()
        self._lock = threading.Lock()

    def track(self, ch: Channel) -> Channel:
        with self._lock:
            full = len(self._open) >= MAX_OPEN
            if not (self.closed or full):
                self._open.add(ch)
                return ch
        ch.close()
        if full:  # each costs a descriptor and a thread: a peer must not use up the process's
            raise ProtocolError(f"more than {MAX_OPEN} data connections on one session")
        raise PeerError("link closed")

    def drop(self, ch: Channel) -> None:
        """The holder lets go of a connection that failed or ended: closed."""
        with self._lock:
            self._open.discard(ch)
        ch.close()

    def give_back(self, pool: queue.Queue[Channel], ch: Channel) -> None:
        """The holder returns a connection that is still in step: idle in ``pool``, or closed if the link is."""
        with self._lock:
            if not self.closed:
                pool.put(ch)
                return
            self._open.discard(ch)
        ch.close()

    def push(self, check: Callable[[], None]) -> Channel:
        """A push connection: an idle one, a new one while fewer than ``streams`` are open, else wait for one."""
        while True:
            try:
                return self.pushes.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                dial = self.open_pushes < self.streams
                if dial:
                    self.open_pushes += 1
            if dial:
                try:
                    return self.track(self.dial("push"))
                except BaseException:
                    self.lost_push(None)
                    raise
            check()
            try:
                return self.pushes.get(timeout=POLL)
            except queue.Empty:
                continue

    def lost_push(self, ch: Channel | None) -> None:
        with self._lock:
            self.open_pushes -= 1
        if ch is not None:
            self.drop(ch)

    def pull(self, check: Callable[[], None]) -> Channel:
        """A connection the producer opened for reads, waiting (and checking) until one is free."""
        while True:
            try:
                return self.pulls.get(timeout=POLL)
            except queue.Empty:
                check()

    def close(self) -> None:
        """Close the idle connections and shut down those a mover holds (it closes them as it lets go)."""
        with self._lock:
            self.closed = True
            idle = []
            for pool in (self.pushes, self.pulls):
                while True:
                    try:
                        idle.append(pool.get_nowait())
                    except queue.Empty:
                        break
            self._open.difference_update(idle)
            held = list(self._open)
        for ch in idle:
            ch.close()
        for ch in held:
            shutdown(ch.sock)
