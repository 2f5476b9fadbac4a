"""Token-based admission: the decode runtime's allocator thinks in tokens, kvxfer's ledger in blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..allocator import FreeList


class TokenAllocator(Protocol):
    """What a decode runtime's KV allocator offers: blocks for ``num_tokens`` tokens, or ``None`` if it
    cannot hold them now (the service then answers ``Busy`` with a retry-after); ``free`` takes them back."""

    def allocate(self, num_tokens: int) -> np.ndarray | None: ...

    def free(self, ids: np.ndarray) -> None: ...


class TokenBlocks:
    """The ``kvxfer.Allocator`` a ``Consumer`` needs, over a runtime allocator that grants blocks for tokens.

    ``block_size`` is tokens per block (the layout's). ``reserve_blocks`` keeps that many blocks free for the
    runtime's own decode growth: an admission that would dip below it is refused (``Busy``), so transfers
    never starve running requests. ``gate`` (set by the service) may refuse admission for other reasons
    (too many handed-off requests waiting for the runtime). ``num_free`` is the runtime's if it has one.
    """

    def __init__(self, runtime: TokenAllocator, block_size: int, *, reserve_blocks: int = 0):
        self.runtime = runtime
        self.block_size = int(block_size)
        self.reserve_blocks = int(reserve_blocks)
        self.gate: Callable[[int], bool] | None = None

    @property
    def num_free(self) -> int:
        return int(getattr(self.runtime, "num_free", -1))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.block_size)

    def allocate(self, n: int) -> np.ndarray | None:
        if self.gate is not None and not self.gate(n):
            return None
        free = self.num_free
        if free >= 0 and free - n < self.reserve_blocks:
            return None
        ids = self.runtime.allocate(n * self.block_size)
        if ids is None:
            return None
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) != n:
            self.runtime.free(ids)
            raise ValueError(
                f"the runtime allocator gave {len(ids)} blocks for {n * self.block_size} tokens, "
                f"expected {n} (block size {self.block_size})"
            )
        return ids

    def free(self, ids: np.ndarray) -> None:
        self.runtime.free(ids)


class PagedPool:
    """A minimal token-based paged allocator (a stand-in for a runtime's, and for tests): a free list of
    ``num_blocks`` blocks of ``block_size`` tokens, minus ``reserved`` ids (a null block, say)."""

    def __init__(self, num_blocks: int, block_size: int, reserved=()):
        self.block_size = block_size
        self.blocks = FreeList(num_blocks, reserved)
        self.capacity = self.blocks.capacity

    @property
    def num_free(self) -> int:
        return self.blocks.num_free

    def allocate(self, num_tokens: int) -> np.ndarray | None:
        return self.blocks.allocate(-(-int(num_tokens) // self.block_size))

    def free(self, ids: np.ndarray) -> None:
        self.blocks.free(ids)
