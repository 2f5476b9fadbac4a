"""The data connections of one TCP link: pooled, dialled on demand up to ``streams``, closed with the link."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ...channel import Channel
from ...errors import PeerError

POLL = 0.25  # how often a wait for a free connection looks at cancel / deadline


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
            if self.closed:
                ch.close()
                raise PeerError("link closed")
            self._open.add(ch)
        return ch

    def drop(self, ch: Channel) -> None:
        with self._lock:
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
        with self._lock:
            self.closed = True
            chans, self._open = list(self._open), set()
        for ch in chans:
            ch.close()
        for pool in (self.pushes, self.pulls):
            while True:
                try:
                    pool.get_nowait().close()
                except queue.Empty:
                    break
