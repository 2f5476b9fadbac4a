"""Destination block allocation on the consumer: the decode runtime's allocator, or a plain free list."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

import numpy as np


class Allocator(Protocol):
    """What a decode runtime supplies: grant ``n`` blocks (or ``None`` when it cannot now), take them back."""

    def allocate(self, n: int) -> np.ndarray | None: ...

    def free(self, ids: np.ndarray) -> None: ...


class FreeList:
    """A thread-safe LIFO free list over ``[0, num_blocks)`` minus ``reserved`` (vLLM's null block 0, say)."""

    def __init__(self, num_blocks: int, reserved: Iterable[int] = ()):
        keep = np.ones(num_blocks, dtype=bool)
        keep[list(reserved)] = False
        self._free = np.flatnonzero(keep)[::-1].astype(np.int64)
        self._top = len(self._free)
        self._lock = threading.Lock()
        self.capacity = self._top

    @property
    def num_free(self) -> int:
        return self._top

    def allocate(self, n: int) -> np.ndarray | None:
        with self._lock:
            if n <= 0 or n > self._top:
                return None
            self._top -= n
            return self._free[self._top : self._top + n][::-1].copy()

    def free(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            if self._top + len(ids) > len(self._free):
                raise RuntimeError("free of more blocks than were allocated")
            self._free[self._top : self._top + len(ids)] = ids[::-1]
            self._top += len(ids)
