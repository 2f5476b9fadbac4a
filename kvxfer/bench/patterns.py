"""Block-id patterns: how a request's blocks lie in a paged cache, on each side of a transfer.

* ``sequential``: consecutive ids (a fresh cache, one long request): runs coalesce into a few large descriptors.
* ``fragmented``: every other block (a cache that has churned): nothing is adjacent, one descriptor per
  layer-block, each ``layer_block_bytes`` long.
* ``permuted``: ids in random order on each side (independently): nothing coalesces and every descriptor
  lands somewhere unrelated to the previous one.

The producer picks its source ids with ``pick``; the consumer hands out destination ids through
``PatternAllocator``, an ``kvxfer.Allocator`` that follows the same pattern over its free blocks.
"""

from __future__ import annotations

import threading

import numpy as np

PATTERNS = ("sequential", "fragmented", "permuted")


def spread(pattern: str) -> int:
    """How many cache blocks a pattern needs per transferred block."""
    return 2 if pattern == "fragmented" else 1


def pick(pattern: str, free: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids out of the sorted candidate ids ``free``, laid out as ``pattern`` says."""
    if n > len(free):
        raise ValueError(f"{n} blocks wanted, {len(free)} available")
    if pattern == "sequential":
        return free[:n].copy()
    if pattern == "fragmented":
        every_other = free[::2]
        return (every_other[:n] if len(every_other) >= n else free[:n]).copy()
    if pattern == "permuted":
        return rng.choice(free, size=n, replace=False)
    raise ValueError(f"unknown pattern {pattern!r}; choose from {PATTERNS}")


def pick_at(pattern: str, num_blocks: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` source ids anywhere in a cache of ``num_blocks`` (latency mode: each request somewhere else)."""
    step = spread(pattern)
    if pattern == "permuted":
        return rng.choice(num_blocks, size=n, replace=False)
    span = step * (n - 1) + 1
    start = int(rng.integers(0, num_blocks - span + 1))
    return start + step * np.arange(n, dtype=np.int64)


class PatternAllocator:
    """A consumer allocator that grants free blocks in the current pattern (thread-safe)."""

    def __init__(self, num_blocks: int, pattern: str = "sequential", seed: int = 0):
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self._lock = threading.Lock()
        self.pattern = pattern
        self.rng = np.random.default_rng(seed)

    def set_pattern(self, pattern: str) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {pattern!r}")
        with self._lock:
            self.pattern = pattern

    @property
    def num_free(self) -> int:
        return int(np.count_nonzero(self._free))

    def allocate(self, n: int) -> np.ndarray | None:
        with self._lock:
            free = np.flatnonzero(self._free)
            if n <= 0 or n > len(free):
                return None
            ids = pick(self.pattern, free, n, self.rng)
            self._free[ids] = False
            return ids.astype(np.int64)

    def free(self, ids) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            if self._free[ids].any():
                raise RuntimeError("double free of benchmark blocks")
            self._free[ids] = True
