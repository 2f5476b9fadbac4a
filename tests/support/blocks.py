"""Byte access to a KVLayout's blocks by id, for checks: every block as rows of one strided array per segment.

A block's byte stream is the concatenation of its segments (``kvxfer/layout.py``); each segment ``s`` is a
``[num_blocks, seg_bytes[s]]`` uint8 view over its region with row stride ``seg_stride[s]``, so reading,
writing or comparing many blocks is one fancy-indexing operation per segment, never a loop over blocks.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvxfer import KVLayout
from kvxfer.memory import host_buffer


class BlockBytes:
    """Writable views of a host layout's blocks (the caller keeps the tensors alive)."""

    def __init__(self, layout: KVLayout):
        self.num_blocks = layout.num_blocks
        self.block_bytes = layout.block_bytes
        bufs = [np.frombuffer(host_buffer(r), dtype=np.uint8) for r in layout.regions]
        self.segments = []
        for r, off, stride, n in zip(
            layout.seg_region.tolist(),
            layout.seg_offset.tolist(),
            layout.seg_stride.tolist(),
            layout.seg_bytes.tolist(),
            strict=False,
        ):
            self.segments.append(
                as_strided(bufs[r][off:], shape=(self.num_blocks, n), strides=(stride, 1), writeable=True)
            )

    def read(self, ids) -> np.ndarray:
        """The byte streams of blocks ``ids``, as a ``[len(ids), block_bytes]`` copy."""
        ids = np.asarray(ids, dtype=np.int64)
        return np.concatenate([seg[ids] for seg in self.segments], axis=1)

    def write(self, ids, data: np.ndarray) -> None:
        """Write ``data`` (``[len(ids), block_bytes]`` uint8) as the byte streams of blocks ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        at = 0
        for seg in self.segments:
            n = seg.shape[1]
            seg[ids] = data[:, at : at + n]
            at += n

    def fill(self, ids, byte: int) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        for seg in self.segments:
            seg[ids] = byte

    def pieces_landed(self, ids, byte: int, tail: int = 64) -> int:
        """How many (block, segment) pieces of ``ids`` no longer end in ``byte``: a piece lands front to back,
        so this counts pieces complete (about), a measure of how far a transfer into them got."""
        ids = np.asarray(ids, dtype=np.int64)
        return int(sum((seg[ids, -tail:] != byte).any(axis=1).sum() for seg in self.segments))

    def differs(self, ids, byte: int, head: int | None = None) -> np.ndarray:
        """Per block of ``ids``: whether any of its bytes (or of the first ``head`` bytes of each segment)
        is not ``byte``."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.zeros(len(ids), dtype=bool)
        for seg in self.segments:
            rows = seg[ids] if head is None else seg[ids, :head]
            out |= (rows != byte).any(axis=1)
        return out


def content(req: str, n: int, block_bytes: int) -> np.ndarray:
    """Bytes that only request ``req`` carries: ``[n, block_bytes]`` uint8 seeded by the request id."""
    seed = int.from_bytes(req.encode()[-16:].rjust(16, b"\0"), "little") ^ len(req)
    return np.frombuffer(np.random.default_rng(seed).bytes(n * block_bytes), dtype=np.uint8).reshape(n, block_bytes)
