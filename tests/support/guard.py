"""An Allocator that catches what a consumer must never do with its blocks: free one twice, free one it was
never given, or let a byte land in one after it was freed.

Every freed block is filled with a poison byte; a block whose poison changed while it was free was written
after its free (checked by ``check()`` and again whenever the block is handed out). Handing out the most
recently freed blocks first (LIFO) makes a late write land in a block another request already owns, the
corruption a real decode runtime would see.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from kvxfer import KVLayout

from .blocks import BlockBytes

POISON = 0xDB


class BadFree(RuntimeError):
    """A free of a block that is not allocated now (a double free, or a block never handed out)."""


@dataclass(frozen=True)
class Fault:
    kind: str  # "double_free", "foreign_free" or "write_after_free"
    blocks: tuple[int, ...]
    at: float  # time.monotonic() when it was found
    where: str = ""  # "check" or "allocate" for a write after free

    def __str__(self) -> str:
        return f"{self.kind} of blocks {list(self.blocks)[:8]}{'...' if len(self.blocks) > 8 else ''} {self.where}"


class GuardedAllocator:
    """The ``kvxfer.Allocator`` protocol over ``[0, num_blocks)`` of ``layout`` (host memory), minus
    ``reserved``, that poisons freed blocks and records every bad free and every write after free."""

    def __init__(self, layout: KVLayout, reserved=(), poison: int = POISON):
        self.blocks = BlockBytes(layout)
        self.poison = poison
        n = layout.num_blocks
        self.state = np.zeros(n, dtype=np.int8)  # 0 free, 1 allocated, -1 reserved
        self.state[list(reserved)] = -1
        self.ever = np.zeros(n, dtype=bool)  # handed out at least once
        self.freed_at = np.zeros(n, dtype=np.float64)
        self._free = [int(b) for b in np.flatnonzero(self.state == 0)[::-1]]
        self.capacity = len(self._free)
        self.faults: list[Fault] = []
        self.allocations = 0
        self._lock = threading.Lock()
        self.blocks.fill(np.flatnonzero(self.state == 0), poison)

    # ---- the Allocator protocol ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> np.ndarray | None:
        with self._lock:
            if n <= 0 or n > len(self._free):
                return None
            ids = np.array(self._free[-n:][::-1], dtype=np.int64)
            del self._free[-n:]
            self._scan(ids, "allocate")
            self.state[ids] = 1
            self.ever[ids] = True
            self.allocations += 1
            return ids

    def free(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        with self._lock:
            bad = ids[(ids < 0) | (ids >= len(self.state))]
            inside = ids[(ids >= 0) & (ids < len(self.state))]
            uniq, counts = np.unique(inside, return_counts=True)
            twice = uniq[(counts > 1) | ((self.state[uniq] == 0) & self.ever[uniq])]
            foreign = np.concatenate([bad, uniq[(self.state[uniq] == -1) | ~self.ever[uniq]]])
            now = time.monotonic()
            if len(twice):
                self.faults.append(Fault("double_free", tuple(twice.tolist()), now))
            if len(foreign):
                self.faults.append(Fault("foreign_free", tuple(foreign.tolist()), now))
            if len(twice) or len(foreign):
                raise BadFree(
                    f"free of blocks not allocated now: double {twice.tolist()[:8]}, "
                    f"never allocated {foreign.tolist()[:8]}"
                )
            self.blocks.fill(ids, self.poison)
            self.state[ids] = 0
            self.freed_at[ids] = now
            self._free.extend(ids[::-1].tolist())

    # ---- checks -----------------------------------------------------------------------------------------
    def _scan(self, ids: np.ndarray, where: str) -> None:
        hit = ids[self.blocks.differs(ids, self.poison)]
        if len(hit):
            self.faults.append(Fault("write_after_free", tuple(hit.tolist()), time.monotonic(), where))
            self.blocks.fill(hit, self.poison)  # counted once

    def check(self) -> list[Fault]:
        """Scan every free block; every write after free found so far (here or at a later allocation)."""
        with self._lock:
            self._scan(np.flatnonzero(self.state == 0), "check")
            return [f for f in self.faults if f.kind == "write_after_free"]

    def bad_frees(self) -> list[Fault]:
        with self._lock:
            return [f for f in self.faults if f.kind != "write_after_free"]

    @property
    def full(self) -> bool:
        return self.num_free == self.capacity

    def touched(self, ids, head: int = 64) -> int:
        """How many of the allocated blocks ``ids`` already hold a byte other than poison (bytes are landing)."""
        return int(self.blocks.differs(ids, self.poison, head).sum())

    def progress(self, ids) -> float:
        """The share of the allocated blocks ``ids`` that holds something other than poison (0 to 1, by pieces)."""
        return self.blocks.pieces_landed(ids, self.poison) / (len(ids) * len(self.blocks.segments))

    def allocated(self) -> np.ndarray:
        with self._lock:
            return np.flatnonzero(self.state == 1)
