"""Per-block integrity digests: an option of a transfer, off by default in production, on in tests.

The producer digests each block's byte stream (all its segments, in order) before sending; the consumer
digests the blocks it received and refuses the request on any mismatch. CRC32C-class checks catch torn or
misplaced blocks, which is what a transport bug produces; they are not a defence against a malicious peer.
"""

from __future__ import annotations

import zlib

import numpy as np

from .errors import TransportError
from .layout import KVLayout
from .memory import HOST, host_buffer


def block_digests(layout: KVLayout, ids) -> bytes:
    """One little-endian uint32 CRC per block of ``ids``, over the block's whole byte stream."""
    if any(r.device != HOST for r in layout.regions):
        raise TransportError("integrity digests are computed on host memory only")
    bufs = [host_buffer(r) for r in layout.regions]
    segs = list(
        zip(
            layout.seg_region.tolist(),
            layout.seg_offset.tolist(),
            layout.seg_stride.tolist(),
            layout.seg_bytes.tolist(),
            strict=True,
        )
    )
    out = np.empty(len(ids), dtype="<u4")
    for i, b in enumerate(np.asarray(ids).tolist()):
        crc = 0
        for r, off, stride, n in segs:
            start = off + b * stride
            crc = zlib.crc32(bufs[r][start : start + n], crc)
        out[i] = crc
    return out.tobytes()


def mismatches(layout: KVLayout, ids, expected: bytes) -> list[int]:
    """Positions in ``ids`` whose digest differs from ``expected`` (all of them if the sizes differ)."""
    got = np.frombuffer(block_digests(layout, ids), dtype="<u4")
    want = np.frombuffer(expected, dtype="<u4") if len(expected) % 4 == 0 else np.empty(0, "<u4")
    if len(want) != len(got):
        return list(range(len(got)))
    return np.flatnonzero(got != want).tolist()
