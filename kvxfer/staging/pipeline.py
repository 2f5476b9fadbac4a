"""Chunked, pipelined moves through staging slots: while the socket moves chunk i, the engine copies the next.

A window is cut into chunks of one slot each; a ring of ``depth`` slots lets the copy of chunk i+1 (device to
host when sending, host to device when receiving) run while chunk i is on the socket. Neither call returns
while a copy it issued is in flight, also when the socket fails: a caller may free the blocks once it returns.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..plan import Extents
from ..sockets import recv_views, send_views
from .engine import CopyEngine, Pending, Slot


class Rings:
    """Rings of ``depth`` staging slots of ``chunk`` bytes, one per concurrent move, made on first use."""

    def __init__(self, engine: CopyEngine, chunk: int = 16 << 20, depth: int = 2):
        self.engine, self.chunk, self.depth = engine, max(1, int(chunk)), max(1, int(depth))
        self._free: queue.SimpleQueue[list[Slot]] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @contextmanager
    def ring(self) -> Iterator[list[Slot]]:
        try:
            slots = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                slots = [self.engine.slot(self.chunk) for _ in range(self.depth)]
        try:
            yield slots
        finally:
            self._free.put(slots)


@contextmanager
def _in_flight(rings: Rings) -> Iterator[tuple[list[Slot], list[Pending | None]]]:
    """A ring and its slots' copies in flight; on the way out, every one of them waited for (the slots go back
    to the ring only idle, and no copy outlives the move)."""
    with rings.ring() as slots:
        pending: list[Pending | None] = [None] * len(slots)
        try:
            yield slots, pending
        finally:
            for p in pending:
                if p is not None:
                    p.wait()


def _take(pending: list[Pending | None], s: int) -> None:
    """Wait for slot ``s``'s copy, if any, before the slot is used again."""
    p, pending[s] = pending[s], None
    if p is not None:
        p.wait()


def send_staged(sock: socket.socket, ext: Extents, rings: Rings) -> None:
    """Send the bytes of ``ext`` in order: gather chunk by chunk into the ring, the next while one sends."""
    parts = ext.split(rings.chunk)
    with _in_flight(rings) as (slots, pending):
        k = len(slots)
        for j in range(min(k, len(parts))):
            pending[j] = rings.engine.gather(parts[j], slots[j])
        for i, part in enumerate(parts):
            s = i % k
            _take(pending, s)
            send_views(sock, [slots[s].view[: part.total]])
            if i + k < len(parts):
                pending[s] = rings.engine.gather(parts[i + k], slots[s])


def recv_staged(sock: socket.socket, ext: Extents, rings: Rings) -> None:
    """Receive the bytes of ``ext`` in order: each chunk into a slot, scattered out while the next arrives."""
    with _in_flight(rings) as (slots, pending):
        for i, part in enumerate(ext.split(rings.chunk)):
            s = i % len(slots)
            _take(pending, s)
            recv_views(sock, [slots[s].view[: part.total]])
            pending[s] = rings.engine.scatter(slots[s], part)
