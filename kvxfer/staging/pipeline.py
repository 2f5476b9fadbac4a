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


def chunks(total: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of consecutive chunks of at most ``size`` bytes covering ``total``."""
    return [(o, min(size, total - o)) for o in range(0, total, size)]


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


def _settle(pending: list[Pending | None]) -> None:
    """Wait for every copy still in flight (the slots go back to the ring only idle)."""
    for p in pending:
        if p is not None:
            p.wait()


def send_staged(sock: socket.socket, ext: Extents, rings: Rings) -> None:
    """Send the bytes of ``ext`` in order: gather chunk by chunk into the ring, the next while one sends."""
    parts = chunks(ext.total, rings.chunk)
    engine = rings.engine
    with rings.ring() as slots:
        k = len(slots)
        pending: list[Pending | None] = [None] * k
        try:
            for j in range(min(k, len(parts))):
                pending[j] = engine.gather(ext.window(*parts[j]), slots[j])
            for i, (_, n) in enumerate(parts):
                s = i % k
                p, pending[s] = pending[s], None
                assert p is not None
                p.wait()
                send_views(sock, [slots[s].view[:n]])
                if i + k < len(parts):
                    pending[s] = engine.gather(ext.window(*parts[i + k]), slots[s])
        finally:
            _settle(pending)


def recv_staged(sock: socket.socket, ext: Extents, rings: Rings) -> None:
    """Receive the bytes of ``ext`` in order: each chunk into a slot, scattered out while the next arrives."""
    parts = chunks(ext.total, rings.chunk)
    engine = rings.engine
    with rings.ring() as slots:
        k = len(slots)
        pending: list[Pending | None] = [None] * k
        try:
            for i, (o, n) in enumerate(parts):
                s = i % k
                p, pending[s] = pending[s], None
                if p is not None:
                    p.wait()
                recv_views(sock, [slots[s].view[:n]])
                pending[s] = engine.scatter(slots[s], ext.window(o, n))
        finally:
            _settle(pending)
